"""Issue 4, item 6, "bad input at every endpoint": each gets its documented
status and code (never a 500), carries `Apiary-Protocol: 1` (checked by the
`api`/`raw_post` helpers), and leaves every queue table exactly as it was."""

import json
import logging

import pytest

from tests.api.conftest import CANARY, raw_post

pytestmark = pytest.mark.django_db

ENDPOINTS = ["register", "worker_heartbeat", "claims", "attempt_heartbeat", "finish"]


def endpoint(world, name: str) -> tuple[str, dict]:
    return dict(zip(ENDPOINTS, world.endpoints(), strict=True))[name]


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response.json()["error"]["code"] == code
    return response.json()["error"]


# --------------------------------------------------------------------------- authentication


@pytest.mark.parametrize("name", ENDPOINTS)
def test_no_token(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        assert_error(api.post(path, body, token=None), 401, "unauthorized")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_wrong_token(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for token in ("wrong", CANARY[:-1], CANARY + "x", CANARY.upper()):
            assert_error(api.post(path, body, token=token), 401, "unauthorized")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_token_with_non_ascii_bytes(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        # latin-1 range: what a WSGI server hands over for raw high bytes (PEP 3333)...
        assert_error(api.post(path, body, token=CANARY + "\xe9\xff"), 401, "unauthorized")
        assert_error(api.post(path, body, token="\x80\x81"), 401, "unauthorized")
        # ...and a str no server could produce, which must not become a 500 either.
        assert_error(api.post(path, body, token=CANARY + "\u2603"), 401, "unauthorized")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_token_in_the_query_string_is_not_accepted(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for query in (f"?token={CANARY}", f"?access_token={CANARY}", f"?authorization=Bearer%20{CANARY}"):
            assert_error(api.post(path + query, body, token=None), 401, "unauthorized")


def test_token_in_the_query_string_is_not_accepted_for_status_and_schema(api, world):
    for path in (f"status?token={CANARY}", f"schema/?token={CANARY}"):
        assert_error(api.get(path, token=None), 401, "unauthorized")


def test_a_query_string_token_is_not_kept_for_logging(api, world, logs):
    api.post(f"claims?token={CANARY}", {}, token=None)
    requests = [r for r in logs if r.name == "django.request"]
    assert requests, "Django logs the 401"  # and the `logs` fixture finds no token in it


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("name", ENDPOINTS)
@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"not json",
        b"{'single': 'quotes'}",
        b'{"a": 1,}',
        b"\xff\xfe{}",  # not UTF-8
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b'{"a": 1e999}',
        b'{"a": "nul \\u0000 inside"}',
    ],
    ids=["truncated", "text", "quotes", "trailing-comma", "not-utf8", "nan", "infinity", "float-overflow", "nul"],
)
def test_garbage_json(api, world, unchanged, name, raw):
    path, _ = endpoint(world, name)
    with unchanged():
        details = assert_error(api.post(path, raw=raw), 400, "invalid_request")["details"]
    assert set(details) == {"body"}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_nesting_100000_deep(api, world, unchanged, name):
    path, _ = endpoint(world, name)
    with unchanged():
        assert_error(api.post(path, raw=b"[" * 100_000 + b"]" * 100_000), 400, "invalid_request")
        assert_error(api.post(path, raw=b'{"a":' * 100_000 + b"1" + b"}" * 100_000), 400, "invalid_request")
        # Shallow enough for json.loads, too deep to store and render safely later.
        assert_error(api.post(path, raw=b"[" * 40 + b"]" * 40), 400, "invalid_request")


def test_deep_summary_is_refused_before_it_is_stored(api, world, unchanged):
    a = world.attempts[0]
    summary = {}
    for _ in range(40):
        summary = {"x": summary}
    with unchanged():
        response = api.post(
            f"attempts/{a.attempt_id}/finish", {"token": a.token, "outcome": "succeeded", "summary": summary}
        )
    assert_error(response, 400, "invalid_request")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_5000_digit_integer(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for field in [*body, "extra"]:
            raw = json.dumps({**body, field: 0}).replace(f'"{field}": 0', f'"{field}": {"9" * 5000}')
            assert_error(api.post(path, raw=raw.encode()), 400, "invalid_request")
        assert_error(api.post(path, raw=b"-" + b"1" * 5000), 400, "invalid_request")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_large_but_parseable_integers_are_out_of_range(api, world, unchanged, name):
    path, body = endpoint(world, name)
    ints = [field for field, value in body.items() if isinstance(value, int) and not isinstance(value, bool)]
    with unchanged():
        for field in ints:
            for value in (2**31, 2**63, 10**100, -(2**63)):
                details = assert_error(api.post(path, {**body, field: value}), 400, "invalid_request")["details"]
                assert field in details


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_lone_surrogate(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for field, value in body.items():
            if isinstance(value, str):
                raw = json.dumps({**body, field: "x\ud800y"})  # json.dumps escapes it as \ud800
                assert "\\ud800" in raw
                assert_error(api.post(path, raw=raw.encode()), 400, "invalid_request")
        assert_error(api.post(path, raw=b'{"\\udfff": 1}'), 400, "invalid_request")  # in a key
        assert_error(api.post(path, raw=b'"\\ud800"'), 400, "invalid_request")


def test_a_lone_surrogate_inside_the_summary(api, world, unchanged):
    a = world.attempts[0]
    raw = json.dumps({"token": a.token, "outcome": "succeeded", "summary": {"out": ["ok", {"tail": "\udc80"}]}})
    with unchanged():
        assert_error(api.post(f"attempts/{a.attempt_id}/finish", raw=raw.encode()), 400, "invalid_request")


WRONG_TYPES = {
    "register": {
        "worker_id": 7,
        "pool": ["gpu"],
        "labels": "linux",
        "capabilities": [1],
        "capacity": "2",
        "version": 1.0,
        "hostname": {},
        "pid": 1.5,
    },
    "worker_heartbeat": {"session": 5, "draining": "yes", "ready": 1},
    "claims": {"worker_id": None, "session": ["s"], "max_jobs": 2.0, "wait": "5"},
    "attempt_heartbeat": {"token": 12345},
    "finish": {"token": None, "outcome": 1, "summary": ["not", "an", "object"], "error": 3},
}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_wrong_types_are_named(api, world, unchanged, name):
    path, _ = endpoint(world, name)
    wrong = WRONG_TYPES[name]
    with unchanged():
        details = assert_error(api.post(path, wrong), 400, "invalid_request")["details"]
    assert set(details) == set(wrong)


@pytest.mark.parametrize("name", ENDPOINTS)
def test_booleans_are_not_integers_and_integers_not_booleans(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for field, value in body.items():
            if isinstance(value, bool):
                swapped = 1 if value else 0
            elif isinstance(value, int):
                swapped = True
            else:
                continue
            details = assert_error(api.post(path, {**body, field: swapped}), 400, "invalid_request")["details"]
            assert set(details) == {field}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_unknown_fields_are_named(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        details = assert_error(api.post(path, {**body, "extra": 1, "Token": "x"}), 400, "invalid_request")["details"]
    assert details == {"extra": ["unknown field"], "Token": ["unknown field"]}


@pytest.mark.parametrize("name", ENDPOINTS)
def test_missing_fields_and_non_objects(api, world, unchanged, name):
    path, _ = endpoint(world, name)
    with unchanged():
        details = assert_error(api.post(path, {}), 400, "invalid_request")["details"]
        assert details and all(messages == ["This field is required."] for messages in details.values())
        for raw in (b"[]", b"1", b'"text"', b"null"):
            assert_error(api.post(path, raw=raw), 400, "invalid_request")
        assert_error(api.post(path, raw=b""), 400, "invalid_request")  # no body at all


@pytest.mark.parametrize("name", ENDPOINTS)
def test_a_body_that_is_not_json(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            response = api.post(path, raw=json.dumps(body).encode(), content_type=content_type)
            assert_error(response, 400, "invalid_request")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_strings_over_their_column_length(api, world, unchanged, name):
    path, body = endpoint(world, name)
    with unchanged():
        for field, value in body.items():
            if isinstance(value, str):
                details = assert_error(api.post(path, {**body, field: "a" * 300}), 400, "invalid_request")["details"]
                assert field in details


def test_register_bounds(api, world, unchanged):
    base = {"worker_id": "w-new", "capacity": 1}
    cases = {
        "worker_id": ["", "-leading-dash", "has space", "a" * 129, "w1\n", "ünïcode", "a/b"],
        "capacity": [0, -1],
        "pid": [-1],
        "labels": [["x" * 129], ["ok"] * 257],
        "pool": ["p" * 129],
    }
    with unchanged():
        for field, values in cases.items():
            for value in values:
                details = assert_error(api.post("workers/register", {**base, field: value}), 400, "invalid_request")[
                    "details"
                ]
                assert field in details, (field, value)


def test_session_must_be_printable_ascii(api, world, unchanged):
    # hmac.compare_digest refuses non-ASCII str: such a session must not reach the service.
    with unchanged():
        for session in ("sessión", "two words", "tab\there", world.session + "\u2603"):
            for path, body in [
                (f"workers/{world.worker_id}/heartbeat", {"session": session}),
                ("claims", {"worker_id": world.worker_id, "session": session}),
            ]:
                details = assert_error(api.post(path, body), 400, "invalid_request")["details"]
                assert set(details) == {"session"}


# --------------------------------------------------------------------------- size


@pytest.mark.parametrize("name", ENDPOINTS)
def test_body_over_the_limit_with_honest_content_length(api, world, unchanged, name, settings):
    path, body = endpoint(world, name)
    oversized = json.dumps({**body, "pad": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}).encode()
    with unchanged():
        assert_error(api.post(path, raw=oversized), 413, "payload_too_large")


@pytest.mark.parametrize("name", ENDPOINTS)
@pytest.mark.parametrize(
    "content_length",
    [None, "", "0", "10", "abc", "-5"],
    ids=["missing", "empty", "zero", "understated", "garbage", "negative"],
)
def test_body_over_the_limit_with_missing_or_understated_content_length(
    world, unchanged, name, content_length, settings
):
    """Where the server delimits the body (gunicorn sets wsgi.input_terminated),
    the actual bytes are counted, whatever Content-Length says."""
    path, body = endpoint(world, name)
    oversized = json.dumps({**body, "pad": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}).encode()
    with unchanged():
        response = raw_post(path, oversized, content_length=content_length, terminated=True)
        assert_error(response, 413, "payload_too_large")
        # Ten times over: still refused, after reading no more than the limit plus one byte.
        response = raw_post(path, oversized * 10, content_length=content_length, terminated=True)
        assert_error(response, 413, "payload_too_large")


@pytest.mark.parametrize("name", ENDPOINTS)
def test_body_within_the_limit_without_content_length_is_read(world, name):
    """Chunked requests (no Content-Length) are read in full when the server delimits them."""
    path, body = endpoint(world, name)
    response = raw_post(path, json.dumps(body).encode(), content_length=None, terminated=True)
    assert response.status_code == 200, response.content


@pytest.mark.parametrize("name", ENDPOINTS)
def test_understated_content_length_without_a_delimiting_server(world, unchanged, name, settings):
    """Without wsgi.input_terminated, PEP 3333 forbids reading past Content-Length
    (it could block); the truncated body is then malformed JSON: 400, not a 500."""
    path, body = endpoint(world, name)
    oversized = json.dumps({**body, "pad": "x" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE}).encode()
    with unchanged():
        response = raw_post(path, oversized, content_length="10", terminated=False)
        assert_error(response, 400, "invalid_request")
        response = raw_post(path, oversized, content_length=str(len(oversized)), terminated=False)
        assert_error(response, 413, "payload_too_large")


def test_oversized_bodies_are_not_read_before_authentication(world, unchanged):
    """An unauthenticated client cannot make the control plane buffer anything."""
    with unchanged():
        response = raw_post("claims", b"x" * (4 << 20), content_length=None, terminated=True, token="wrong")
    assert_error(response, 401, "unauthorized")


# --------------------------------------------------------------------------- ranges


@pytest.mark.parametrize("wait", [-1, -0.001, 30.001, 31, 1e308, "5", True, None, [1]])
def test_wait_out_of_range(api, world, unchanged, wait):
    body = {"worker_id": world.worker_id, "session": world.session, "max_jobs": 1, "wait": wait}
    with unchanged():
        details = assert_error(api.post("claims", body), 400, "invalid_request")["details"]
    assert set(details) == {"wait"}


def test_wait_with_a_huge_integer(api, world, unchanged):
    raw = f'{{"worker_id": "{world.worker_id}", "session": "{world.session}", "wait": {"9" * 400}}}'
    with unchanged():
        details = assert_error(api.post("claims", raw=raw.encode()), 400, "invalid_request")["details"]
    assert set(details) == {"wait"}


@pytest.mark.parametrize("max_jobs", [0, -1, 2**31])
def test_max_jobs_out_of_range(api, world, unchanged, max_jobs):
    body = {"worker_id": world.worker_id, "session": world.session, "max_jobs": max_jobs}
    with unchanged():
        details = assert_error(api.post("claims", body), 400, "invalid_request")["details"]
    assert set(details) == {"max_jobs"}


def test_max_jobs_beyond_free_capacity_is_not_an_error(api, world):
    body = {"worker_id": world.worker_id, "session": world.session, "max_jobs": 50}
    response = api.post("claims", body)
    assert response.status_code == 200 and len(response.json()["jobs"]) == 1  # capacity 3, two held


def test_unknown_attempt(api, world, unchanged):
    a = world.attempts[0]
    with unchanged():
        assert_error(api.post("attempts/424242/heartbeat", {"token": a.token}), 404, "not_found")
        assert_error(api.post("attempts/424242/finish", {"token": a.token, "outcome": "failed"}), 404, "not_found")


def test_another_attempts_token(api, world, unchanged):
    a, b = world.attempts
    with unchanged():
        assert_error(api.post(f"attempts/{a.attempt_id}/heartbeat", {"token": b.token}), 409, "stale_attempt")
        response = api.post(f"attempts/{b.attempt_id}/finish", {"token": a.token, "outcome": "succeeded"})
        assert_error(response, 409, "stale_attempt")


@pytest.mark.parametrize("version", ["v0", "v2", "v10", "V1", "1"])
def test_a_retired_protocol_version_path(api, world, unchanged, version):
    a = world.attempts[0]
    with unchanged():
        for path, body in world.endpoints() + [
            (f"attempts/{a.attempt_id}/finish", {"token": a.token, "outcome": "succeeded"})
        ]:
            response = api.request(
                "POST", f"/api/worker/{version}/{path}", data=json.dumps(body), content_type="application/json"
            )
            assert_error(response, 404, "unsupported_protocol")


def test_log_capture_sees_the_apiary_loggers(logs):
    """The `logs` fixture must see non-propagating loggers, or the canary checks prove nothing."""
    logging.getLogger("apiary.api").debug("probe %s", "x")
    assert any(r.name == "apiary.api" and r.getMessage() == "probe x" for r in logs)

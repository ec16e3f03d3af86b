"""A job's journal over protocol v1 (PROTOCOL.md "POST attempts/{attempt_id}/records",
"…/records/list" and the heartbeat's `checkpoint`): the service's rules
(jobqueue/services/records.py) hold on the wire, under WSGI and ASGI alike
(the `api` fixture), and a call that is refused records nothing."""

import json

import pytest

from jobqueue import services
from jobqueue.models import JobRecord
from jobqueue.types import MAX_CHECKPOINT_BYTES, MAX_RECORD_VALUE_BYTES
from tests.api.conftest import CANARY, credential_for
from tests.factories import claim, enqueue, register

pytestmark = pytest.mark.django_db

RECORD_FIELDS = {"key", "state", "value", "attempt_number", "started_by", "started_earlier", "already_done"}


def error(response) -> dict:
    return response.json()["error"]


def held(worker_id="w1"):
    """A job and the attempt of `worker_id` that holds it."""
    job = enqueue()
    worker = register(worker_id)
    [c] = claim(worker)
    return job, worker, c


def record(api, c, key="step:plan", state="done", value=None, **extra):
    body = {"token": c.token, "key": key, "state": state, **({} if value is None else {"value": value}), **extra}
    return api.post(f"attempts/{c.attempt_id}/records", body)


def listed(api, c) -> list[dict]:
    response = api.post(f"attempts/{c.attempt_id}/records/list", {"token": c.token})
    assert response.status_code == 200, response.content
    return response.json()["records"]


def expire_and_reclaim(clock, worker, lease):
    clock.advance(lease + 1)
    services.leases_expire()
    [again] = claim(worker)
    return again


# --------------------------------------------------------------------------- the rules, on the wire


def test_a_record_is_kept_and_listed(api, clock):
    job, _, c = held()
    response = record(api, c, value={"output": "a plan"})
    assert response.status_code == 200, response.content
    assert response.json() == {
        "record": {
            "key": "step:plan", "state": "done", "value": {"output": "a plan"}, "attempt_number": 1,
            "started_by": None, "started_earlier": False, "already_done": False,
        }
    }  # fmt: skip
    assert services.records_of_job(job.pk)["step:plan"].value == {"output": "a plan"}
    assert record(api, c, key="publish:open-pr", state="started").json()["record"]["started_by"] == 1
    records = listed(api, c)
    assert [(r["key"], r["state"]) for r in records] == [("step:plan", "done"), ("publish:open-pr", "started")]
    assert all(set(r) == RECORD_FIELDS for r in records)


def test_a_record_without_a_value_has_an_empty_one(api, clock):
    _, _, c = held()
    assert record(api, c, key="publish:deploy", state="started").json()["record"]["value"] == {}


def test_started_again_by_a_later_attempt_says_an_earlier_one_started_it(api, clock, queue_config):
    queue_config(lease_duration=5)
    _, worker, first = held()
    assert record(api, first, key="publish:deploy", state="started").json()["record"]["started_earlier"] is False
    second = expire_and_reclaim(clock, worker, 5)
    answer = record(api, second, key="publish:deploy", state="started").json()["record"]
    assert (answer["started_earlier"], answer["started_by"], answer["attempt_number"]) == (True, 1, 2)
    resent = record(api, second, key="publish:deploy", state="started").json()["record"]  # its answer was lost
    assert (resent["started_earlier"], resent["started_by"]) == (True, 1)
    done = record(api, second, key="publish:deploy", state="done", value={"output": "ok"}).json()["record"]
    assert (done["state"], done["started_by"], done["attempt_number"], done["already_done"]) == ("done", 1, 2, False)


def test_done_is_final_and_answers_the_recorded_value(api, clock, queue_config):
    queue_config(lease_duration=5)
    _, worker, first = held()
    record(api, first, key="publish:open-pr", value={"output": "https://example/pr/1"})
    for state in ("started", "done"):
        answer = record(api, first, key="publish:open-pr", state=state, value={"output": "another"}).json()["record"]
        assert (answer["state"], answer["value"], answer["already_done"]) == (
            "done", {"output": "https://example/pr/1"}, True
        )  # fmt: skip
    second = expire_and_reclaim(clock, worker, 5)
    answer = record(api, second, key="publish:open-pr", state="started").json()["record"]
    assert answer["already_done"] and answer["value"] == {"output": "https://example/pr/1"}
    assert JobRecord.objects.get().value == {"output": "https://example/pr/1"}
    assert [r["value"] for r in listed(api, second)] == [{"output": "https://example/pr/1"}]


# --------------------------------------------------------------------------- a stale attempt records nothing


@pytest.mark.parametrize("how", ["wrong-token", "expired", "superseded", "finished", "not-current"])
def test_a_stale_attempt_records_nothing(api, clock, queue_config, unchanged, how):
    queue_config(lease_duration=5)
    _, worker, c = held()
    token, code = c.token, "stale_attempt"
    if how == "wrong-token":
        token = "not-the-token"
    elif how == "expired":
        clock.advance(6)  # no reaper has run: the lease has passed all the same
    elif how == "superseded":
        register("w1")
        code = "session_superseded"
    elif how == "finished":
        services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    elif how == "not-current":
        expire_and_reclaim(clock, worker, 5)
    calls = [
        ("records", {"token": token, "key": "step:plan", "state": "done", "value": {"output": "late"}}),
        ("records/list", {"token": token}),
        ("heartbeat", {"token": token, "checkpoint": {"step": "plan", "content": "late"}}),
    ]
    with unchanged():
        for path, body in calls:
            response = api.post(f"attempts/{c.attempt_id}/{path}", body)
            assert response.status_code == 409 and error(response)["code"] == code, (path, response.content)
    assert not JobRecord.objects.exists()


@pytest.mark.parametrize("path", ["records", "records/list"])
def test_an_unknown_attempt_is_not_found(api, clock, unchanged, path):
    _, _, c = held()
    body = {"token": c.token} if path == "records/list" else {"token": c.token, "key": "k", "state": "done"}
    with unchanged():
        response = api.post(f"attempts/424242/{path}", body)
    assert response.status_code == 404 and error(response)["code"] == "not_found"


def test_another_workers_credential_is_refused(api, clock, unchanged):
    _, _, c = held("w1")
    register("w2")
    other = credential_for("w2")
    with unchanged():
        for path, body in [
            ("records", {"token": c.token, "key": "step:plan", "state": "done"}),
            ("records/list", {"token": c.token}),
            ("heartbeat", {"token": c.token, "checkpoint": {"step": "plan", "content": "x"}}),
        ]:
            response = api.post(f"attempts/{c.attempt_id}/{path}", body, token=other)
            assert response.status_code == 403 and error(response)["code"] == "worker_mismatch", path


def test_the_shared_token_cannot_write_a_workers_journal(api, clock, unchanged):
    _, _, c = held("w1")
    credential_for("w1")  # w1 has a credential: the shared token no longer acts for it
    with unchanged():
        response = api.post(
            f"attempts/{c.attempt_id}/records", {"token": c.token, "key": "k", "state": "done"}, token=CANARY
        )
    assert response.status_code == 403 and error(response)["code"] == "credential_required"


@pytest.mark.parametrize("path", ["records", "records/list"])
def test_no_token_is_unauthorized(api, clock, unchanged, path):
    _, _, c = held()
    with unchanged():
        response = api.post(f"attempts/{c.attempt_id}/{path}", {"token": c.token}, token=None)
    assert response.status_code == 401 and error(response)["code"] == "unauthorized"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"extra": 1}, {"extra"}),
        ({"key": ""}, {"key"}),
        ({"key": "k" * 256}, {"key"}),
        ({"key": 5}, {"key"}),
        ({"state": "finished"}, {"state"}),
        ({"state": True}, {"state"}),
        ({"value": "not an object"}, {"value"}),
        ({"value": [1, 2]}, {"value"}),
        ({"value": {"output": "x" * MAX_RECORD_VALUE_BYTES}}, {"value"}),
        ({"token": 7, "key": None}, {"token", "key"}),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(api, clock, unchanged, change, fields):
    _, _, c = held()
    body = {"token": c.token, "key": "step:plan", "state": "done", "value": {}, **change}
    with unchanged():
        response = api.post(f"attempts/{c.attempt_id}/records", body)
    assert response.status_code == 400 and error(response)["code"] == "invalid_request", response.content
    assert set(error(response)["details"]) == fields


@pytest.mark.parametrize("body", [{}, {"token": "t", "key": "k"}, {"token": 5}])
def test_a_bad_list_request_is_refused_naming_the_field(api, clock, unchanged, body):
    _, _, c = held()
    with unchanged():
        response = api.post(f"attempts/{c.attempt_id}/records/list", body)
    assert response.status_code == 400 and error(response)["code"] == "invalid_request"
    assert set(error(response)["details"]) == ({"key"} if "key" in body else {"token"})


def test_a_body_over_the_limit_is_refused(api, clock, unchanged, settings):
    _, _, c = held()
    for path in ("records", "records/list"):
        with unchanged():
            response = api.post(f"attempts/{c.attempt_id}/{path}", raw=b" " * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1))
        assert response.status_code == 413 and error(response)["code"] == "payload_too_large"


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_sent_with_a_heartbeat_is_kept_and_listed(api, clock):
    _, _, c = held()
    beat = api.post(
        f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": {"step": "implement", "content": "turn 1"}}
    )
    assert beat.status_code == 200 and set(beat.json()) == {"lease_expires_at", "cancel"}
    clock.advance(1)
    api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": {"step": "implement", "content": "é" * 10}})
    [kept] = listed(api, c)
    assert (kept["key"], kept["state"], kept["value"]) == ("checkpoint:implement", "started", {"content": "é" * 10})


def test_a_checkpoint_extends_the_lease_like_any_heartbeat(api, clock, queue_config):
    queue_config(lease_duration=10)
    _, _, c = held()
    clock.advance(8)
    api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": {"step": "plan", "content": ""}})
    clock.advance(8)  # past the first lease, inside the extended one
    assert record(api, c).status_code == 200


def test_a_heartbeat_without_a_checkpoint_records_nothing(api, clock):
    _, _, c = held()
    for body in ({"token": c.token}, {"token": c.token, "checkpoint": None}):
        assert api.post(f"attempts/{c.attempt_id}/heartbeat", body).status_code == 200
    assert not JobRecord.objects.exists()


def test_a_checkpoint_never_overrides_a_done_record_and_is_never_done(api, clock):
    _, _, c = held()
    record(api, c, key="checkpoint:plan", state="done", value={"content": "final"})
    api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": {"step": "plan", "content": "later"}})
    assert JobRecord.objects.get().value == {"content": "final"}


@pytest.mark.parametrize(
    ("checkpoint", "inner"),
    [
        ({"step": "plan"}, "content"),
        ({"content": "x"}, "step"),
        ({"step": "", "content": "x"}, "step"),
        ({"step": "no spaces", "content": "x"}, "step"),
        ({"step": "s" * 129, "content": "x"}, "step"),
        ({"step": "plan", "content": 5}, "content"),
        ({"step": "plan", "content": "x" * (MAX_CHECKPOINT_BYTES + 1)}, "content"),
        ({"step": "plan", "content": "é" * (MAX_CHECKPOINT_BYTES // 2 + 1)}, "content"),  # bytes, not characters
        ({"step": "plan", "content": "x", "extra": 1}, "extra"),
        ("plan", None),
    ],
)
def test_a_bad_checkpoint_is_refused_naming_the_field(api, clock, unchanged, checkpoint, inner):
    _, _, c = held()
    with unchanged():
        response = api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": checkpoint})
    assert response.status_code == 400 and error(response)["code"] == "invalid_request", response.content
    details = error(response)["details"]
    assert set(details) == {"checkpoint"}
    if inner is not None:
        assert inner in json.dumps(details["checkpoint"])


def test_the_largest_checkpoint_is_kept(api, clock):
    _, _, c = held()
    content = "x" * MAX_CHECKPOINT_BYTES
    response = api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token, "checkpoint": {"step": "s", "content": content}})
    assert response.status_code == 200
    assert JobRecord.objects.get().value == {"content": content}


# --------------------------------------------------------------------------- the schema


def test_the_schema_describes_the_journal(api):
    document = api.get("schema/").json()
    paths = document["paths"]
    for path in ("/api/worker/v1/attempts/{attempt_id}/records", "/api/worker/v1/attempts/{attempt_id}/records/list"):
        assert {"200", "400", "401", "403", "404", "409", "413", "503"} <= set(paths[path]["post"]["responses"])
    schemas = document["components"]["schemas"]
    assert schemas["RecordRequest"]["additionalProperties"] is False
    assert schemas["RecordRequest"]["properties"]["key"]["maxLength"] == 255
    assert set(schemas["RecordView"]["properties"]) == RECORD_FIELDS
    assert "checkpoint" in schemas["AttemptHeartbeatRequest"]["properties"]
    assert schemas["CheckpointRequest"]["additionalProperties"] is False

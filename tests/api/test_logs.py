"""Live step logs over protocol v1 (PROTOCOL.md "POST attempts/{attempt_id}/logs" and
"GET instances/{instance_id}/logs…"): a running attempt streams its steps'
output in bounded chunks, fenced by its token like its journal; a resent
chunk is stored once; a stream keeps its last MiB with a count of what was
dropped; operators read it back with the shared token, never with a worker's
own credential (a step can read that file). Under WSGI and ASGI alike (the `api` fixture)."""

import pytest

from jobqueue import services
from jobqueue.models import LogChunk, LogStream
from jobqueue.types import MAX_LOG_CHUNK_BYTES, MAX_LOG_STREAM_BYTES, MAX_LOG_STREAMS_PER_ATTEMPT
from tests.api.conftest import CANARY, credential_for
from tests.factories import claim, enqueue, instance_id, register

pytestmark = pytest.mark.django_db

STATE_FIELDS = {"stream", "received", "dropped", "ended", "stored"}


def error(response) -> dict:
    return response.json()["error"]


def held(worker_id="w1"):
    job = enqueue()
    worker = register(worker_id)
    [c] = claim(worker)
    return job, worker, c


def send(api, c, text, *, offset=0, stream="plan", token=None, **extra):
    body = {"token": c.token if token is None else token, "stream": stream, "offset": offset, "text": text, **extra}
    return api.post(f"attempts/{c.attempt_id}/logs", body)


def sent(api, c, text, **kwargs) -> dict:
    response = send(api, c, text, **kwargs)
    assert response.status_code == 200, response.content
    return response.json()


def read(api, job, attempt=1, step="plan", offset=0, **kwargs) -> dict:
    response = api.get(f"instances/{instance_id(job)}/logs/{attempt}/{step}/{offset}", **kwargs)
    assert response.status_code == 200, response.content
    return response.json()


def whole(api, job, attempt=1, step="plan") -> str:
    """The step's log as a follower reads it: from 0, page after page."""
    text, offset = [], 0
    while True:
        page = read(api, job, attempt, step, offset)
        text.append(page["text"])
        if page["next_offset"] >= page["received"]:
            return "".join(text)
        offset = page["next_offset"]


def nothing_stored():
    return not LogStream.objects.exists() and not LogChunk.objects.exists()


# --------------------------------------------------------------------------- appending


def test_chunks_are_appended_at_their_offsets_and_read_back_in_order(api, clock):
    job, _, c = held()
    first = sent(api, c, "étape 1\n")
    assert set(first) == STATE_FIELDS
    assert first == {"stream": "plan", "received": 9, "dropped": 0, "ended": False, "stored": True}  # 9 bytes of UTF-8
    assert sent(api, c, "step 2\n", offset=9)["received"] == 16
    assert whole(api, job) == "étape 1\nstep 2\n"
    listing = api.get(f"instances/{instance_id(job)}/logs").json()
    assert listing["state"] == "leased" and listing["attempt_number"] == 1
    [step] = listing["steps"]
    assert (step["step"], step["attempt_number"], step["attempt_state"], step["worker_id"]) == ("plan", 1, "active", "w1")
    assert (step["received"], step["dropped"], step["ended"], step["hook"]) == (16, 0, False, None)


def test_a_resent_chunk_is_stored_once(api, clock):
    """At-least-once delivery: the answer to a chunk was lost and the worker sends it again."""
    job, _, c = held()
    sent(api, c, "one\n")
    again = sent(api, c, "one\n")
    assert again == {"stream": "plan", "received": 4, "dropped": 0, "ended": False, "stored": False}
    sent(api, c, "two\n", offset=4)
    assert sent(api, c, "two\n", offset=4)["stored"] is False
    assert whole(api, job) == "one\ntwo\n"


def test_a_chunk_overlapping_the_end_adds_only_what_lies_beyond_it(api, clock):
    job, _, c = held()
    sent(api, c, "abc")
    assert sent(api, c, "bcdé", offset=1)["received"] == 6
    assert whole(api, job) == "abcdé"


def test_a_chunk_overlapping_the_end_inside_a_character_is_refused(api, clock):
    job, _, c = held()
    sent(api, c, "ab")
    response = send(api, c, "éx", offset=1)  # byte 2 is inside é
    assert response.status_code == 400
    assert "offset" in error(response)["details"]
    assert whole(api, job) == "ab"


def test_a_stream_keeps_its_last_mib_and_counts_what_it_dropped(api, clock):
    job, _, c = held()
    chunk = "x" * (MAX_LOG_CHUNK_BYTES - 1) + "\n"
    offset = 0
    for _ in range(MAX_LOG_STREAM_BYTES // MAX_LOG_CHUNK_BYTES + 3):
        state = sent(api, c, chunk, offset=offset)
        offset = state["received"]
    sent(api, c, "the last words\n", offset=offset)
    stream = LogStream.objects.get()
    assert stream.received == offset + 15
    assert stream.dropped > 0 and stream.received - stream.dropped <= MAX_LOG_STREAM_BYTES
    assert sum(LogChunk.objects.values_list("size", flat=True)) == stream.received - stream.dropped
    page = read(api, job, offset=0)
    assert page["offset"] == page["dropped"] == stream.dropped  # a reader from 0 learns where the kept text begins
    text = whole(api, job)
    assert text.endswith("x\nthe last words\n") and len(text.encode()) == stream.received - stream.dropped


def test_a_chunk_beyond_the_end_drops_what_was_kept_before_it(api, clock):
    """A sender that skipped text it knew would not be kept (more than a MiB behind)."""
    job, _, c = held()
    sent(api, c, "old\n")
    state = sent(api, c, "new\n", offset=5_000_000)
    assert (state["received"], state["dropped"]) == (5_000_004, 5_000_000)
    assert whole(api, job) == "new\n"


def test_small_chunks_share_rows(api, clock):
    job, _, c = held()
    offset = 0
    for n in range(200):
        offset = sent(api, c, f"line {n}\n", offset=offset)["received"]
    assert LogChunk.objects.count() == 1
    assert whole(api, job) == "".join(f"line {n}\n" for n in range(200))


def test_a_final_chunk_ends_the_stream(api, clock):
    job, _, c = held()
    sent(api, c, "done\n", final=True)
    assert read(api, job)["ended"] is True
    assert sent(api, c, "done\n", final=True)["stored"] is False  # the last chunk, resent
    response = send(api, c, "more\n", offset=5)
    assert response.status_code == 400 and "offset" in error(response)["details"]
    assert whole(api, job) == "done\n"


def test_an_empty_final_chunk_at_the_end_ends_the_stream(api, clock):
    job, _, c = held()
    sent(api, c, "out\n")
    assert sent(api, c, "", offset=4, final=True) == {
        "stream": "plan", "received": 4, "dropped": 0, "ended": True, "stored": False,
    }  # fmt: skip


def test_streams_are_kept_per_attempt_and_step(api, clock, queue_config):
    queue_config(lease_duration=5)
    job, worker, first = held()
    sent(api, first, "attempt one\n")
    sent(api, first, "hook-less step\n", stream="review")
    clock.advance(6)
    services.leases_expire()
    [second] = claim(worker)
    sent(api, second, "attempt two\n")
    assert whole(api, job, 1) == "attempt one\n" and whole(api, job, 2) == "attempt two\n"
    listing = api.get(f"instances/{instance_id(job)}/logs").json()
    assert listing["attempt_number"] == 2
    assert [(s["attempt_number"], s["step"], s["attempt_state"]) for s in listing["steps"]] == [
        (1, "plan", "expired"), (1, "review", "expired"), (2, "plan", "active"),
    ]  # fmt: skip


# --------------------------------------------------------------------------- fenced like the journal


def test_another_attempts_token_is_stale_and_stores_nothing(api, clock):
    _, _, c = held()
    response = send(api, c, "forged\n", token="not-the-token")
    assert response.status_code == 409 and error(response)["code"] == "stale_attempt"
    assert nothing_stored()


def test_an_expired_attempt_stores_nothing(api, clock, queue_config):
    queue_config(lease_duration=5)
    _, _, c = held()
    clock.advance(6)  # the lease ran out; the reaper has not run yet
    response = send(api, c, "too late\n")
    assert response.status_code == 409 and error(response)["code"] == "stale_attempt"
    assert nothing_stored()


def test_a_finished_attempt_stores_nothing(api, clock):
    _, _, c = held()
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    response = send(api, c, "after the finish\n")
    assert response.status_code == 409 and error(response)["code"] == "stale_attempt"
    assert nothing_stored()


def test_another_workers_credential_is_refused(api, clock):
    _, _, c = held()
    register("w2")
    body = {"token": c.token, "stream": "plan", "offset": 0, "text": "x"}
    response = api.post(f"attempts/{c.attempt_id}/logs", body, token=credential_for("w2"))
    assert response.status_code == 403 and error(response)["code"] == "worker_mismatch"
    assert nothing_stored()


def test_the_shared_token_cannot_append(api, clock):
    _, _, c = held()
    credential_for("w1")  # w1 has a credential: the shared token no longer acts for it
    body = {"token": c.token, "stream": "plan", "offset": 0, "text": "x"}
    response = api.post(f"attempts/{c.attempt_id}/logs", body, token=CANARY)
    assert response.status_code == 403 and error(response)["code"] == "credential_required"
    assert nothing_stored()


def test_an_unknown_attempt_is_not_found(api, clock):
    response = api.post("attempts/999999/logs", {"token": "t", "stream": "plan", "offset": 0, "text": "x"})
    assert response.status_code == 404 and error(response)["code"] == "not_found"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"text": "x" * (MAX_LOG_CHUNK_BYTES + 1)}, "text"),
        ({"text": "é" * (MAX_LOG_CHUNK_BYTES // 2 + 1)}, "text"),  # the bound is bytes, not characters
        ({"text": "nul \x00 inside"}, "body"),  # the protocol parser refuses NUL in any JSON string
        ({"text": 5}, "text"),
        ({"stream": ""}, "stream"),
        ({"stream": "-dash-first"}, "stream"),
        ({"stream": "a/b"}, "stream"),
        ({"stream": "s" * 256}, "stream"),
        ({"offset": -1}, "offset"),
        ({"offset": True}, "offset"),
        ({"offset": "0"}, "offset"),
        ({"offset": 2**62 + 1}, "offset"),
        ({"final": "yes"}, "final"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_chunks_are_refused_naming_the_field(api, clock, change, field):
    _, _, c = held()
    body = {"token": c.token, "stream": "plan", "offset": 0, "text": "ok", **change}
    response = api.post(f"attempts/{c.attempt_id}/logs", body)
    assert response.status_code == 400, response.content
    assert error(response)["code"] == "invalid_request" and field in error(response)["details"]
    assert nothing_stored()


def test_a_missing_field_is_named(api, clock):
    _, _, c = held()
    response = api.post(f"attempts/{c.attempt_id}/logs", {"token": c.token, "stream": "plan", "text": "x"})
    assert response.status_code == 400 and "offset" in error(response)["details"]


def test_a_chunk_of_exactly_the_limit_is_taken(api, clock):
    job, _, c = held()
    assert sent(api, c, "é" * (MAX_LOG_CHUNK_BYTES // 2))["received"] == MAX_LOG_CHUNK_BYTES


def test_an_attempt_keeps_at_most_so_many_streams(api, clock):
    _, _, c = held()
    for n in range(MAX_LOG_STREAMS_PER_ATTEMPT):
        sent(api, c, "x", stream=f"s{n}")
    response = send(api, c, "x", stream="one-more")
    assert response.status_code == 400 and "stream" in error(response)["details"]
    assert sent(api, c, "y", stream="s0", offset=1)["received"] == 2  # the existing ones go on


# --------------------------------------------------------------------------- reading


def test_reading_takes_the_shared_token_and_never_a_workers_own_credential(api, clock):
    job, _, c = held()
    sent(api, c, "visible\n")
    register("w2")
    assert read(api, job, token=CANARY)["text"] == "visible\n"
    assert api.get(f"instances/{instance_id(job)}/logs", token=CANARY).status_code == 200
    for token in (credential_for("w2"), credential_for("w1")):  # another worker's, and the writer's own
        for path in (f"instances/{instance_id(job)}/logs", f"instances/{instance_id(job)}/logs/1/plan/0"):
            response = api.get(path, token=token)
            assert response.status_code == 403 and error(response)["code"] == "operator_token_required"
            assert "visible" not in response.content.decode()


def test_reading_without_a_token_is_unauthorized(api, clock):
    job, _, c = held()
    sent(api, c, "secret\n")
    for path in (f"instances/{instance_id(job)}/logs", f"instances/{instance_id(job)}/logs/1/plan/0"):
        response = api.get(path, token=None)
        assert response.status_code == 401 and "secret" not in response.content.decode()


def test_an_unknown_instance_attempt_or_step_is_not_found(api, clock):
    job, _, c = held()
    sent(api, c, "x")
    for path in (
        "instances/999999/logs",
        "instances/999999/logs/1/plan/0",
        f"instances/{instance_id(job)}/logs/2/plan/0",
        f"instances/{instance_id(job)}/logs/1/review/0",
        f"instances/{instance_id(job)}/logs/1/hook:failed:notify/0",
    ):
        response = api.get(path)
        assert response.status_code == 404, path
        assert error(response)["code"] == "not_found" and error(response)["message"]


def test_an_offset_past_the_end_reads_nothing(api, clock):
    job, _, c = held()
    sent(api, c, "abc")
    page = read(api, job, offset=10**18)
    assert (page["offset"], page["text"], page["next_offset"]) == (3, "", 3)


def test_registration_lists_the_logs_feature(api):
    body = {"worker_id": "w9", "capacity": 1}
    assert "logs" in api.post("workers/register", body).json()["features"]

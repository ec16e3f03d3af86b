"""Every endpoint of PROTOCOL.md, its answer, and every row of its error table."""

import datetime as dt
import json

import pytest
from django.db import OperationalError, connection

from jobqueue import selectors, services
from jobqueue.models import Attempt, AttemptState, Job, JobEvent, JobState, Worker
from tests.api.conftest import CANARY, credential_for
from tests.factories import claim, enqueue, instance_id, make_task, register

pytestmark = pytest.mark.django_db

JOB_FIELDS = {
    "job_id",
    "attempt_id",
    "attempt_number",
    "token",
    "lease_expires_at",
    "workflow",
    "instance_id",
    "agent",
    "runner",
    "task",
}


def rfc3339(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def register_over_api(api, worker_id="w1", **fields):
    body = {"worker_id": worker_id, "capacity": 2, "capabilities": ["apiary.workflow", "runner:shell"], **fields}
    response = api.post("workers/register", body)
    assert response.status_code == 200, response.content
    return response.json()


def error(response) -> dict:
    return response.json()["error"]


# --------------------------------------------------------------------------- happy paths


def test_register_starts_a_session_and_answers_the_configured_durations(api, clock, queue_config):
    queue_config(lease_duration=12.5, heartbeat_interval=4.0, worker_timeout=20.0)
    body = {
        "worker_id": "gpu-box.1_a",
        "pool": "gpu",
        "labels": ["linux", "cuda"],
        "capabilities": ["apiary.workflow", "runner:shell"],
        "capacity": 3,
        "version": "0.1.0",
        "hostname": "gpu-box",
        "pid": 4242,
    }
    answer = api.post("workers/register", body).json()
    worker = Worker.objects.get(pk="gpu-box.1_a")
    assert answer["session"] == worker.session and len(answer["session"]) >= 32
    assert answer["protocol"] == 1
    assert (answer["lease_duration"], answer["heartbeat_interval"], answer["worker_timeout"]) == (12.5, 4.0, 20.0)
    view = answer["worker"]
    assert view["worker_id"] == "gpu-box.1_a" and view["pool"] == "gpu"
    assert view["labels"] == ["cuda", "linux"] and view["capacity"] == 3
    assert (view["version"], view["hostname"], view["pid"]) == ("0.1.0", "gpu-box", 4242)
    assert view["registered_at"] == rfc3339(clock.now())
    assert (view["draining"], view["ready"], view["drain_requested"]) == (False, True, False)


def test_register_defaults_optional_fields(api):
    answer = api.post("workers/register", {"worker_id": "w1", "capacity": 1}).json()
    assert answer["worker"]["pool"] is None and answer["worker"]["labels"] == [] and answer["worker"]["pid"] is None


def test_worker_heartbeat_records_state_and_answers_drain(api, clock):
    session = register_over_api(api)["session"]
    clock.advance(5)
    answer = api.post("workers/w1/heartbeat", {"session": session, "draining": True, "ready": True}).json()
    assert answer == {"drain": False}
    worker = Worker.objects.get(pk="w1")
    assert worker.draining and worker.ready and worker.last_heartbeat_at == clock.now()
    services.worker_drain(worker_id="w1")
    assert api.post("workers/w1/heartbeat", {"session": session, "draining": True, "ready": False}).json() == {
        "drain": True
    }
    assert not Worker.objects.get(pk="w1").ready


def test_claim_returns_the_protocol_job_shape(api, clock, queue_config):
    queue_config(lease_duration=40)
    task = make_task(source="inbox", item_key="bug-12.md", title="Bug 12", body="it breaks", payload={"n": 1})
    job = enqueue(task, workflow="triage", agent="engineer", runner="shell")
    session = register_over_api(api)["session"]
    [claimed] = api.post("claims", {"worker_id": "w1", "session": session, "max_jobs": 1, "wait": 0}).json()["jobs"]
    assert set(claimed) == JOB_FIELDS
    attempt = Attempt.objects.get(pk=claimed["attempt_id"])
    assert claimed["job_id"] == job.pk and attempt.job_id == job.pk and attempt.worker_id == "w1"
    assert claimed["attempt_number"] == 1
    assert claimed["instance_id"] == instance_id(job)
    assert (claimed["workflow"], claimed["agent"], claimed["runner"]) == ("triage", "engineer", "shell")
    assert claimed["lease_expires_at"] == rfc3339(clock.now() + dt.timedelta(seconds=40))
    assert claimed["task"] == {
        "id": task.pk,
        "source": "inbox",
        "item_key": "bug-12.md",
        "generation": 1,
        "title": "Bug 12",
        "body": "it breaks",
        "payload": {"n": 1},
    }
    assert claimed["token"] not in json.dumps(list(Attempt.objects.values()), default=str)  # only its hash is kept
    assert Job.objects.get(pk=job.pk).state == JobState.LEASED


def test_claim_with_nothing_queued_answers_an_empty_list(api):
    session = register_over_api(api)["session"]
    assert api.post("claims", {"worker_id": "w1", "session": session}).json() == {"jobs": []}


def test_max_jobs_beyond_free_capacity_gets_the_free_capacity(api, unchanged):
    for _ in range(5):
        enqueue()
    session = register_over_api(api, capacity=3)["session"]
    first = api.post("claims", {"worker_id": "w1", "session": session, "max_jobs": 1}).json()["jobs"]
    response = api.post("claims", {"worker_id": "w1", "session": session, "max_jobs": 1000})
    assert response.status_code == 200
    assert len(first) == 1 and len(response.json()["jobs"]) == 2
    with unchanged():  # full: a further claim is an empty answer, not an error
        assert api.post("claims", {"worker_id": "w1", "session": session, "max_jobs": 2**31 - 1}).json() == {"jobs": []}


def test_attempt_heartbeat_extends_the_lease_and_reports_cancel(api, clock, queue_config):
    queue_config(lease_duration=30)
    job = enqueue()
    [c] = claim(register())
    clock.advance(10)
    answer = api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token}).json()
    assert answer == {"lease_expires_at": rfc3339(clock.now() + dt.timedelta(seconds=30)), "cancel": False}
    assert Attempt.objects.get(pk=c.attempt_id).lease_expires_at == clock.now() + dt.timedelta(seconds=30)
    services.job_cancel(job_id=job.pk)
    assert api.post(f"attempts/{c.attempt_id}/heartbeat", {"token": c.token}).json()["cancel"] is True


def test_finish_settles_the_job_and_a_repeat_gets_the_same_answer(api):
    job = enqueue()
    [c] = claim(register())
    body = {"token": c.token, "outcome": "succeeded", "summary": {"steps": 2, "note": "ok"}, "error": None}
    assert api.post(f"attempts/{c.attempt_id}/finish", body).json() == {"job_state": "succeeded"}
    events = JobEvent.objects.count()
    assert api.post(f"attempts/{c.attempt_id}/finish", body).json() == {"job_state": "succeeded"}
    assert JobEvent.objects.count() == events
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and job.summary == {"steps": 2, "note": "ok"}


def test_finish_after_a_cancel_ends_cancelled(api):
    job = enqueue()
    [c] = claim(register())
    services.job_cancel(job_id=job.pk)
    answer = api.post(f"attempts/{c.attempt_id}/finish", {"token": c.token, "outcome": "succeeded"}).json()
    assert answer == {"job_state": "cancelled"}


def test_failed_finish_reports_the_job_state(api):
    enqueue()
    [c] = claim(register())
    body = {"token": c.token, "outcome": "failed", "error": "exit 3"}
    assert api.post(f"attempts/{c.attempt_id}/finish", body).json() == {"job_state": "failed"}
    assert Attempt.objects.get(pk=c.attempt_id).error == "exit 3"


def test_status_is_the_selectors_document(api, clock):
    enqueue()
    enqueue()
    claim(register("w1"))
    answer = api.get("status").json()
    assert answer == json.loads(json.dumps(selectors.status_document()))
    assert set(answer) == {"jobs", "workers", "active", "blocked"}
    assert answer["jobs"]["queued"] == 1 and answer["jobs"]["leased"] == 1
    assert [w["worker_id"] for w in answer["workers"]] == ["w1"]


def test_schema_is_an_openapi_document_of_every_endpoint(api):
    response = api.get("schema/")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == {
        "/api/worker/v1/workers/register",
        "/api/worker/v1/workers/{worker_id}/heartbeat",
        "/api/worker/v1/claims",
        "/api/worker/v1/attempts/{attempt_id}/heartbeat",
        "/api/worker/v1/attempts/{attempt_id}/finish",
        "/api/worker/v1/attempts/{attempt_id}/records",
        "/api/worker/v1/attempts/{attempt_id}/records/list",
        "/api/worker/v1/attempts/{attempt_id}/logs",
        "/api/worker/v1/status",
        "/api/worker/v1/instances/{instance_id}/logs",
        "/api/worker/v1/instances/{instance_id}/logs/{attempt_number}/{step}/{offset}",
    }
    scheme = document["components"]["securitySchemes"]["workerToken"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer") and "credential" in scheme["description"]
    claims = document["paths"]["/api/worker/v1/claims"]["post"]
    assert claims["security"] == [{"workerToken": []}]
    assert {"200", "400", "401", "403", "404", "409", "413", "429", "503"} <= set(claims["responses"])
    register = document["paths"]["/api/worker/v1/workers/register"]["post"]
    assert "403" in register["responses"]
    assert "credential" in document["components"]["schemas"]["RegisterResponse"]["properties"]
    assert claims["responses"]["409"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    request = document["components"]["schemas"]["ClaimRequest"]
    assert request["additionalProperties"] is False
    assert request["properties"]["wait"]["maximum"] == 30


def test_schema_requires_the_token(api):
    response = api.get("schema/", token=None)
    assert response.status_code == 401 and error(response)["code"] == "unauthorized"


# --------------------------------------------------------------------------- the error table


def test_400_names_the_fields(api, world, unchanged):
    with unchanged():
        response = api.post("claims", {"worker_id": "bad id!", "max_jobs": 0, "wait": 31})
    assert response.status_code == 400
    assert error(response)["code"] == "invalid_request"
    assert set(error(response)["details"]) == {"worker_id", "session", "max_jobs", "wait"}


def test_400_from_the_service_names_its_field(api, world, unchanged):
    # The service's own InvalidRequest (not the serializer's) keeps its field.
    a = world.attempts[0]
    with unchanged():
        response = api.post(f"attempts/{a.attempt_id}/finish", {"token": a.token, "outcome": "exploded"})
    assert response.status_code == 400 and set(error(response)["details"]) == {"outcome"}


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Bearer wrong-token", f"Bearer {CANARY} extra", f"Basic {CANARY}", f"Token {CANARY}", CANARY],
)
def test_401_for_a_missing_malformed_or_wrong_token(api, world, unchanged, authorization):
    headers = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    for path, body in world.endpoints():
        with unchanged():
            response = api.post(path, body, token=None, headers=headers)
        assert response.status_code == 401, path
        assert error(response)["code"] == "unauthorized"
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="apiary"'
    assert api.get("status", token=None, headers=headers).status_code == 401


def test_401_for_every_request_when_no_token_is_configured(api, world, unchanged, settings):
    for configured in ("", None):
        settings.APIARY_WORKER_TOKEN = configured
        for path, body in world.endpoints():
            with unchanged():
                assert api.post(path, body, token=CANARY).status_code == 401
        assert api.get("status", token=CANARY).status_code == 401
        assert api.get("status", token="").status_code == 401


def test_404_for_an_unknown_worker(api, world, unchanged):
    with unchanged():
        response = api.post("workers/nobody/heartbeat", {"session": world.session})
        assert response.status_code == 404 and error(response)["code"] == "not_found"
        response = api.post("claims", {"worker_id": "nobody", "session": world.session})
        assert response.status_code == 404 and error(response)["code"] == "not_found"


@pytest.mark.parametrize(
    "path", ["attempts/999999/heartbeat", "attempts/999999/finish", "attempts/999999999999999999/finish"]
)
def test_404_for_an_unknown_attempt(api, world, unchanged, path):
    with unchanged():
        response = api.post(
            path,
            {"token": world.attempts[0].token, "outcome": "succeeded"}
            if path.endswith("finish")
            else {"token": world.attempts[0].token},
        )
    assert response.status_code == 404 and error(response)["code"] == "not_found"


@pytest.mark.parametrize(
    "path",
    [
        "/api/worker/v0/claims",
        "/api/worker/v2/claims",
        "/api/worker/v2/attempts/1/finish",
        "/api/worker/claims",
        "/api/worker/",
        "/api/worker",
        "/api/worker/v1.1/status",
    ],
)
def test_404_unsupported_protocol_for_other_versions(api, world, unchanged, path):
    for method in ("GET", "POST", "PUT", "DELETE"):
        with unchanged():
            response = api.request(method, path, data=b"{}", content_type="application/json")
        assert response.status_code == 404, (method, path)
        assert error(response)["code"] == "unsupported_protocol"
        assert error(response)["details"] == {"supported": [1]}


@pytest.mark.parametrize(
    "path",
    [
        "/api/worker/v1/",
        "/api/worker/v1",
        "/api/worker/v1/nope",
        "/api/worker/v1/schema",
        "/api/worker/v1/workers/bad%20id/heartbeat",
        "/api/worker/v1/attempts/abc/heartbeat",
        "/api/worker/v1/attempts/-1/finish",
        "/api/worker/v1/attempts/9999999999999999999999999/finish",
    ],
)
def test_404_not_found_for_unknown_paths(api, world, unchanged, path):
    with unchanged():
        response = api.request("POST", path, data=b"{}", content_type="application/json")
    assert response.status_code == 404 and error(response)["code"] == "not_found"


def test_405_for_a_method_the_endpoint_does_not_have(api, world, unchanged):
    with unchanged():
        for method, path in [
            ("GET", "/api/worker/v1/claims"),
            ("POST", "/api/worker/v1/status"),
            ("OPTIONS", "/api/worker/v1/claims"),
            ("DELETE", "/api/worker/v1/workers/register"),
        ]:
            response = api.request(method, path, data=b"{}", content_type="application/json")
            assert response.status_code == 405 and error(response)["code"] == "method_not_allowed"


def test_409_stale_attempt_for_another_attempts_token(api, world, unchanged):
    a, b = world.attempts
    with unchanged():
        for path, body in [
            (f"attempts/{a.attempt_id}/heartbeat", {"token": b.token}),
            (f"attempts/{a.attempt_id}/finish", {"token": b.token, "outcome": "succeeded"}),
            (f"attempts/{a.attempt_id}/finish", {"token": "", "outcome": "succeeded"}),
        ]:
            response = api.post(path, body)
            assert response.status_code in (400, 409), body
            if body["token"]:
                assert response.status_code == 409 and error(response)["code"] == "stale_attempt"


def test_409_stale_attempt_after_the_lease_expired(api, clock, unchanged, queue_config):
    queue_config(lease_duration=10)
    enqueue()
    [c] = claim(register())
    clock.advance(11)  # expired, though no reaper has run yet
    with unchanged():
        for path, body in [
            (f"attempts/{c.attempt_id}/heartbeat", {"token": c.token}),
            (f"attempts/{c.attempt_id}/finish", {"token": c.token, "outcome": "succeeded"}),
        ]:
            response = api.post(path, body)
            assert response.status_code == 409 and error(response)["code"] == "stale_attempt"


def test_409_stale_attempt_when_not_the_current_attempt(api, clock, unchanged, queue_config):
    queue_config(lease_duration=10)
    job = enqueue()
    [old] = claim(register("w1"))
    clock.advance(11)
    services.leases_expire()
    [new] = claim(register("w2"))
    assert new.job_id == job.pk and new.attempt_number == 2
    with unchanged():
        response = api.post(f"attempts/{old.attempt_id}/finish", {"token": old.token, "outcome": "succeeded"})
    assert response.status_code == 409 and error(response)["code"] == "stale_attempt"
    assert Attempt.objects.get(pk=old.attempt_id).state == AttemptState.EXPIRED


def test_409_stale_attempt_for_a_finish_with_another_outcome(api, unchanged):
    enqueue()
    [c] = claim(register())
    api.post(f"attempts/{c.attempt_id}/finish", {"token": c.token, "outcome": "succeeded"})
    with unchanged():
        response = api.post(f"attempts/{c.attempt_id}/finish", {"token": c.token, "outcome": "failed"})
    assert response.status_code == 409 and error(response)["code"] == "stale_attempt"


def test_409_session_superseded_after_registering_again(api, unchanged):
    old = register_over_api(api)["session"]
    register_over_api(api)
    with unchanged():
        for path, body in [
            ("workers/w1/heartbeat", {"session": old}),
            ("claims", {"worker_id": "w1", "session": old}),
        ]:
            response = api.post(path, body)
            assert response.status_code == 409 and error(response)["code"] == "session_superseded"


def test_413_for_a_body_over_the_limit(api, world, unchanged, settings):
    for path, _ in world.endpoints():
        with unchanged():
            response = api.post(path, raw=b" " * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1))
        assert response.status_code == 413 and error(response)["code"] == "payload_too_large"


def test_a_body_of_exactly_the_limit_is_read(api, world, settings):
    a = world.attempts[0]
    body = json.dumps({"token": a.token, "outcome": "succeeded", "summary": {"pad": ""}})
    padding = settings.DATA_UPLOAD_MAX_MEMORY_SIZE - len(body)
    body = json.dumps({"token": a.token, "outcome": "succeeded", "summary": {"pad": "x" * padding}})
    assert len(body) == settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    response = api.post(f"attempts/{a.attempt_id}/finish", raw=body.encode())
    assert response.status_code == 200 and response.json() == {"job_state": "succeeded"}


def _failing_queries(message):
    def wrapper(execute, sql, params, many, context):
        if sql.split(None, 1)[0].upper() in {"SAVEPOINT", "RELEASE", "ROLLBACK"}:
            return execute(sql, params, many, context)
        raise OperationalError(message)

    return wrapper


def test_503_when_the_database_is_locked(api, world, unchanged):
    with unchanged(), connection.execute_wrapper(_failing_queries("database is locked")):
        responses = [api.post(path, body) for path, body in world.endpoints()]
        responses.append(api.get("status"))
    for response in responses:
        assert response.status_code == 503 and error(response)["code"] == "unavailable"
        assert response.headers["Retry-After"] == "1"


def test_503_does_not_echo_the_database_error(api, world):
    secret = 'connection to server at "10.9.8.7", port 5432 failed: password authentication failed for user "apiary"'
    with connection.execute_wrapper(_failing_queries(secret)):
        response = api.post("claims", {"worker_id": world.worker_id, "session": world.session})
    assert response.status_code == 503 and b"10.9.8.7" not in response.content


def test_unexpected_errors_are_a_json_500(api, world, monkeypatch):
    # The goal is that nothing gets here; when something does, it is still JSON.
    def broken(**kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(services, "worker_heartbeat", broken)
    response = api.client.post(
        f"/api/worker/v1/workers/{world.worker_id}/heartbeat",
        {"session": world.session},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {credential_for(world.worker_id)}",
    )
    assert response.status_code == 500 and response["Apiary-Protocol"] == "1"
    assert response.json()["error"]["code"] == "internal_error" and b"boom" not in response.content


def test_the_protocol_document_names_every_error_code_the_api_answers():
    """PROTOCOL.md (the project's copy) and the code stay in step: each code is in its error table."""
    from pathlib import Path

    from jobqueue.api.errors import CODES

    document = (Path(__file__).resolve().parents[2] / "PROTOCOL.md").read_text()
    table = {line.split("|")[2].strip().strip("`") for line in document.splitlines() if line.startswith("| 4")}
    table |= {line.split("|")[2].strip().strip("`") for line in document.splitlines() if line.startswith("| 5")}
    documented_elsewhere = {"unsupported_protocol"}  # in the 404 row's text
    assert set(CODES) - documented_elsewhere <= table, set(CODES) - documented_elsewhere - table

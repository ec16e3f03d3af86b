"""Schemathesis against the served OpenAPI document, in process (WSGI).

Generated requests (valid and deliberately invalid) must never get a 5xx,
and every answer must match the document: its status is documented, its
Content-Type, headers and body fit the schema. Hand-made cases cover the 200
answers that random ids cannot reach (a claim, an attempt's heartbeat and
finish). Examples are few and derandomized so the run stays short and stable.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import CANARY, credential_for, wsgi_app

pytestmark = pytest.mark.django_db

AUTH = {"Authorization": f"Bearer {CANARY}"}
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
MAX_EXAMPLES = 25


@pytest.fixture
def schema(db):
    return schemathesis.openapi.from_wsgi("/api/worker/v1/schema/", wsgi_app(), headers=AUTH)


def operations(schema) -> dict:
    return {op.label: op for op in (result.ok() for result in schema.get_all_operations())}


def call(case, checks, headers=AUTH):
    response = case.call_and_validate(headers=headers, checks=checks)
    assert CANARY.encode() not in response.content
    return response


def fuzz(operation, mode, checks, record) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis_settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        record(call(case, checks).status_code)

    run()


def test_the_document_lists_every_operation(schema):
    assert set(operations(schema)) == {
        "POST /api/worker/v1/workers/register",
        "POST /api/worker/v1/workers/{worker_id}/heartbeat",
        "POST /api/worker/v1/claims",
        "POST /api/worker/v1/attempts/{attempt_id}/heartbeat",
        "POST /api/worker/v1/attempts/{attempt_id}/finish",
        "POST /api/worker/v1/attempts/{attempt_id}/records",
        "POST /api/worker/v1/attempts/{attempt_id}/records/list",
        "POST /api/worker/v1/attempts/{attempt_id}/logs",
        "GET /api/worker/v1/status",
        "GET /api/worker/v1/instances/{instance_id}/logs",
        "GET /api/worker/v1/instances/{instance_id}/logs/{attempt_number}/{step}/{offset}",
    }


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_generated_requests(schema, world, mode, settings):
    checks = CONFORMANCE + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    statuses = []
    for label, operation in operations(schema).items():
        fuzz(operation, mode, checks, lambda status, label=label: statuses.append((label, status)))
    assert len(statuses) >= len(operations(schema)) * 5
    assert any(status == 200 for _, status in statuses) if mode is GenerationMode.POSITIVE else True
    if mode is GenerationMode.NEGATIVE:
        assert {status for _, status in statuses} & {400, 404}


def test_unauthenticated_answers_conform(schema, world):
    for operation in operations(schema).values():
        path_parameters = {
            "worker_id": world.worker_id, "attempt_id": str(world.attempts[0].attempt_id),
            "instance_id": str(world.jobs[0].payload["instance_id"]), "attempt_number": "1", "step": "plan", "offset": "0",
        }  # fmt: skip
        path_parameters = {k: v for k, v in path_parameters.items() if "{" + k + "}" in operation.path}
        if operation.method.upper() == "GET":
            case = operation.Case(path_parameters=path_parameters)
        else:
            case = operation.Case(path_parameters=path_parameters, body={}, media_type="application/json")
        response = case.call(headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401
        case.validate_response(response, checks=CONFORMANCE)


def test_successful_answers_conform(schema, world):
    ops = operations(schema)
    a, b = world.attempts
    cases = [
        (
            "POST /api/worker/v1/workers/{worker_id}/heartbeat",
            {"worker_id": world.worker_id},
            {"session": world.session, "draining": False, "ready": True},
        ),
        ("POST /api/worker/v1/claims", {}, {"worker_id": world.worker_id, "session": world.session, "max_jobs": 5}),
        ("POST /api/worker/v1/attempts/{attempt_id}/heartbeat", {"attempt_id": str(a.attempt_id)}, {"token": a.token}),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/heartbeat",
            {"attempt_id": str(a.attempt_id)},
            {"token": a.token, "checkpoint": {"step": "plan", "content": "turn 1"}},
        ),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/records",
            {"attempt_id": str(a.attempt_id)},
            {"token": a.token, "key": "publish:open-pr", "state": "done", "value": {"output": "ok"}},
        ),
        ("POST /api/worker/v1/attempts/{attempt_id}/records/list", {"attempt_id": str(a.attempt_id)}, {"token": a.token}),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/logs",
            {"attempt_id": str(a.attempt_id)},
            {"token": a.token, "stream": "plan", "offset": 0, "text": "step output\n"},
        ),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/finish",
            {"attempt_id": str(a.attempt_id)},
            {"token": a.token, "outcome": "succeeded", "summary": {"k": [1, "v"]}, "error": None},
        ),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/finish",
            {"attempt_id": str(b.attempt_id)},
            {"token": b.token, "outcome": "failed", "error": "exit 1"},
        ),
        (
            "POST /api/worker/v1/attempts/{attempt_id}/finish",
            {"attempt_id": str(b.attempt_id)},
            {"token": a.token, "outcome": "failed"},
        ),  # 409
        ("POST /api/worker/v1/workers/register", {}, {"worker_id": world.worker_id, "capacity": 2}),
        ("POST /api/worker/v1/claims", {}, {"worker_id": world.worker_id, "session": world.session}),  # 409 now
    ]
    statuses = []
    as_worker = {"Authorization": f"Bearer {credential_for(world.worker_id)}"}
    for label, path_parameters, body in cases:
        case = ops[label].Case(path_parameters=path_parameters, body=body, media_type="application/json")
        statuses.append(call(case, CONFORMANCE, as_worker).status_code)
    response = call(ops["GET /api/worker/v1/status"].Case(), CONFORMANCE)
    assert response.status_code == 200
    assert statuses == [200, 200, 200, 200, 200, 200, 200, 200, 200, 409, 200, 409]
    instance = {"instance_id": str(world.jobs[0].payload["instance_id"])}
    assert world.jobs[0].pk == a.job_id
    listing = call(ops["GET /api/worker/v1/instances/{instance_id}/logs"].Case(path_parameters=instance), CONFORMANCE)
    assert [step["step"] for step in listing.json()["steps"]] == ["plan"]
    page = ops["GET /api/worker/v1/instances/{instance_id}/logs/{attempt_number}/{step}/{offset}"].Case(
        path_parameters={**instance, "attempt_number": "1", "step": "plan", "offset": "0"}
    )
    assert call(page, CONFORMANCE).json()["text"] == "step output\n"

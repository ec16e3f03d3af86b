"""The worker token is never logged, echoed or stored.

Every test of this package already runs with the canary token and checks each
response and every log record for it (conftest). This test drives the whole
protocol once more with SQL logging switched on, then searches every text
column of every table for the token.
"""

import pytest
from django.db import connection

from jobqueue import services
from tests.api.conftest import CANARY, raw_post
from tests.factories import enqueue

pytestmark = pytest.mark.django_db


def database_text() -> str:
    """Every row of every table, as text."""
    chunks = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            chunks.extend(repr(row) for row in cursor.fetchall())
    return "\n".join(chunks)


@pytest.fixture
def sql_logging():
    """Log every SQL statement with its parameters (django.db.backends, DEBUG)."""
    connection.force_debug_cursor = True
    yield
    connection.force_debug_cursor = False


def test_the_token_never_appears_in_bodies_logs_or_rows(api, clock, logs, sql_logging):
    for _ in range(3):
        enqueue()
    caps = ["apiary.workflow", "runner:shell"]
    session = api.post("workers/register", {"worker_id": "w1", "capacity": 3, "capabilities": caps}).json()["session"]
    api.post("workers/w1/heartbeat", {"session": session, "draining": False, "ready": True})
    jobs = api.post("claims", {"worker_id": "w1", "session": session, "max_jobs": 3, "wait": 0.05}).json()["jobs"]
    assert len(jobs) == 3
    first, second, third = jobs
    api.post(f"attempts/{first['attempt_id']}/heartbeat", {"token": first["token"]})
    api.post(
        f"attempts/{first['attempt_id']}/finish", {"token": first["token"], "outcome": "succeeded", "summary": {"a": 1}}
    )
    api.post(
        f"attempts/{second['attempt_id']}/finish", {"token": second["token"], "outcome": "failed", "error": "exit 1"}
    )
    services.job_cancel(job_id=third["job_id"])
    api.post(f"attempts/{third['attempt_id']}/heartbeat", {"token": third["token"]})
    api.post(f"attempts/{third['attempt_id']}/finish", {"token": third["token"], "outcome": "cancelled"})
    assert api.get("status").status_code == 200
    assert api.get("schema/").status_code == 200
    # Errors of every kind, with the canary in the places a careless client puts it.
    api.post("claims", {"worker_id": "w1", "session": session}, token=CANARY + "x")
    api.post("claims", {"worker_id": "w1", "session": session}, token=None, headers={"HTTP_AUTHORIZATION": CANARY})
    api.post(f"claims?token={CANARY}", {"worker_id": "w1", "session": session}, token=None)
    api.post("claims", {"worker_id": "w1", "session": session}, token=CANARY + "\u2603")
    api.post("claims", raw=b"{garbage")
    api.post("claims", {"worker_id": "w1", "session": "stale"})
    api.post(f"attempts/{first['attempt_id']}/finish", {"token": second["token"], "outcome": "failed"})
    api.post("attempts/99999/heartbeat", {"token": first["token"]})
    api.get(f"/api/worker/v2/claims?token={CANARY}", absolute=True)
    raw_post("claims", b"x" * (2 << 20), content_length=None, terminated=True)

    assert any(r.name == "django.db.backends" for r in logs), "SQL logging was on"
    assert CANARY not in database_text()
    # The fixture `logs` asserts, after this test, that no record holds the token.

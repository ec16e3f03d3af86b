"""A remote worker's own database (.apiary/workers/<id>.db) across versions."""

import datetime as dt
import sqlite3

from jobqueue.types import Claim
from workers.localdb import LocalDB

# step_runs as Apiary wrote it before the one-way layers (keyed by instance id).
OLD_SCHEMA = """
CREATE TABLE step_runs (
    instance_id INTEGER NOT NULL, attempt_number INTEGER NOT NULL, step_id TEXT NOT NULL,
    job_id INTEGER NOT NULL, attempt_id INTEGER NOT NULL, workflow TEXT NOT NULL,
    status TEXT NOT NULL, started_at TEXT NOT NULL, ended_at TEXT, exit_code INTEGER,
    log_path TEXT, output_tail TEXT,
    PRIMARY KEY (instance_id, attempt_number, step_id));
CREATE TABLE finish_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, attempt_id INTEGER NOT NULL, job_id INTEGER NOT NULL,
    token TEXT NOT NULL, outcome TEXT NOT NULL, summary TEXT NOT NULL, error TEXT,
    written_at TEXT NOT NULL, acked_at TEXT, answer TEXT);
INSERT INTO finish_outbox (attempt_id, job_id, token, outcome, summary, error, written_at)
VALUES (3, 4, 'undelivered', 'succeeded', '{}', NULL, '2026-01-01T00:00:00+00:00');
"""


def test_a_database_from_before_keeps_its_undelivered_finishes_and_takes_step_history(tmp_path):
    path = tmp_path / "w1.db"
    old = sqlite3.connect(path)
    old.executescript(OLD_SCHEMA)
    old.close()
    local = LocalDB(path)
    claim = Claim(
        job_id=1, attempt_id=1, attempt_number=1, token="t", lease_expires_at=dt.datetime.now(dt.UTC),
        agent="a", runner="shell", payload={"workflow": "w", "instance_id": 1, "task": {"id": 1}},
    )
    local.step_started(claim=claim, worker_id="w1", step_id="s", started_at=dt.datetime.now(dt.UTC), log_path="x")
    assert [(e["attempt_id"], e["token"]) for e in local.pending()] == [(3, "undelivered")]
    local.close()
    assert LocalDB(path).pending()[0]["token"] == "undelivered"  # opening again changes nothing

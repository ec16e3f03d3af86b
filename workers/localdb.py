"""A remote worker's own SQLite database, `.apiary/workers/<worker-id>.db`:
detailed workflow and step history, and the outbox of finishes.

A finish is written to the outbox before it is sent and stays there until the
control plane acknowledges it (or refuses it as stale), so a finish survives
a lost response, a control-plane restart and a restart of the worker itself.
"""

import datetime as dt
import json
import sqlite3
import threading
from pathlib import Path

from jobqueue.types import Claim

from . import private

SCHEMA = """
CREATE TABLE IF NOT EXISTS step_runs (
    job_id INTEGER NOT NULL, attempt_number INTEGER NOT NULL, step_id TEXT NOT NULL,
    attempt_id INTEGER NOT NULL, status TEXT NOT NULL, started_at TEXT NOT NULL, ended_at TEXT,
    exit_code INTEGER, log_path TEXT, output_tail TEXT,
    PRIMARY KEY (job_id, attempt_number, step_id)
);
-- Keyed by a row id of its own: attempt ids start again if the control
-- plane's database is ever recreated, and a new finish must never be skipped.
CREATE TABLE IF NOT EXISTS finish_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, attempt_id INTEGER NOT NULL, job_id INTEGER NOT NULL,
    token TEXT NOT NULL, outcome TEXT NOT NULL, summary TEXT NOT NULL, error TEXT,
    written_at TEXT NOT NULL, acked_at TEXT, answer TEXT
);
"""


# PRAGMA user_version of the schema above. Version 0 files (Apiary before the
# one-way layers) keyed step_runs by instance id: that table is history only,
# so it is dropped and made anew; the outbox, which holds undelivered
# finishes, has the same shape in both and is kept.
SCHEMA_VERSION = 1


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


class LocalDB:
    def __init__(self, path: Path):
        private.private_dir(path.parent)
        private.private_sqlite(path)  # 0600, and so its -wal and -shm
        self.path = path
        self.lock = threading.Lock()
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        if self.db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            self.db.execute("DROP TABLE IF EXISTS step_runs")
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self.db.executescript(SCHEMA)

    def _run(self, statement: str, params=()):
        with self.lock:
            return self.db.execute(statement, params).fetchall()

    # executor.History

    def step_started(self, *, claim: Claim, worker_id: str, step_id: str, started_at: dt.datetime, log_path: str) -> None:
        self._run(
            "INSERT OR REPLACE INTO step_runs (job_id, attempt_number, step_id, attempt_id,"
            " status, started_at, log_path) VALUES (?, ?, ?, ?, 'running', ?, ?)",
            (claim.job_id, claim.attempt_number, step_id, claim.attempt_id, started_at.isoformat(), log_path),
        )

    def step_finished(self, *, claim: Claim, worker_id: str, step_id: str, result) -> None:
        self._run(
            "UPDATE step_runs SET status = ?, ended_at = ?, exit_code = ?, output_tail = ?"
            " WHERE job_id = ? AND attempt_number = ? AND step_id = ?",
            (result.status, result.ended_at.isoformat(), result.exit_code, result.output_tail,
             claim.job_id, claim.attempt_number, step_id),
        )

    # the outbox

    def record_finish(self, *, claim: Claim, outcome: str, summary: dict, error: str | None) -> int:
        """Write the finish before it is sent; returns its outbox id."""
        with self.lock:
            cursor = self.db.execute(
                "INSERT INTO finish_outbox (attempt_id, job_id, token, outcome, summary, error, written_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (claim.attempt_id, claim.job_id, claim.token, outcome, json.dumps(summary), error, _now()),
            )
            return cursor.lastrowid

    def acknowledge(self, entry_id: int, answer: str) -> None:
        """The control plane answered (or refused for good): the token is no longer kept."""
        self._run("UPDATE finish_outbox SET acked_at = ?, answer = ?, token = '' WHERE id = ?", (_now(), answer, entry_id))

    def pending(self) -> list[dict]:
        rows = self._run(
            "SELECT id, attempt_id, job_id, token, outcome, summary, error FROM finish_outbox"
            " WHERE acked_at IS NULL ORDER BY id"
        )
        return [
            {"id": i, "attempt_id": a, "job_id": j, "token": t, "outcome": o, "summary": json.loads(s), "error": e}
            for i, a, j, t, o, s, e in rows
        ]

    def close(self) -> None:
        with self.lock:
            self.db.close()

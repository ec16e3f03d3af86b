"""The physical ceiling: the claim+finish lifecycle in plain sqlite3.

Same durability as Apiary's settings (WAL, synchronous=FULL, BEGIN IMMEDIATE),
a similar schema (a job table with the same partial claim-order index, an
attempt table with a hashed token and a lease), one claim transaction and one
finish transaction per job, no ORM and no event rows. Run as
`python -m bench.bare_sqlite JSON`; prints one `RESULT {json}` line.
"""

import datetime as dt
import hashlib
import json
import os
import secrets
import sqlite3
import sys
import tempfile
import time

SCHEMA = """
CREATE TABLE job (
    id INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, state TEXT NOT NULL, priority INTEGER NOT NULL,
    available_at TEXT NOT NULL, attempt_count INTEGER NOT NULL, current_attempt_id INTEGER,
    summary TEXT NOT NULL DEFAULT '{}', finished_at TEXT
);
CREATE INDEX job_claim_order ON job (priority DESC, available_at, id) WHERE state = 'queued';
CREATE TABLE attempt (
    id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL REFERENCES job (id), number INTEGER NOT NULL,
    token_hash TEXT NOT NULL, state TEXT NOT NULL, claimed_at TEXT NOT NULL, lease_expires_at TEXT NOT NULL,
    finished_at TEXT
);
"""

CLAIM = (
    "SELECT id, attempt_count FROM job WHERE state = 'queued' AND available_at <= ?"
    " ORDER BY priority DESC, available_at, id LIMIT 1"
)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(" ")


def lifecycle(db: sqlite3.Connection) -> bool:
    """One claim transaction, then one finish transaction; False when the queue is empty."""
    t = now()
    db.execute("BEGIN IMMEDIATE")
    row = db.execute(CLAIM, [t]).fetchone()
    if row is None:
        db.execute("COMMIT")
        return False
    job_id, count = row
    token = secrets.token_urlsafe(32)
    lease = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)).isoformat(" ")
    attempt_id = db.execute(
        "INSERT INTO attempt (job_id, number, token_hash, state, claimed_at, lease_expires_at)"
        " VALUES (?, ?, ?, 'active', ?, ?) RETURNING id",
        [job_id, count + 1, hashlib.sha256(token.encode()).hexdigest(), t, lease],
    ).fetchone()[0]
    db.execute(
        "UPDATE job SET state = 'leased', current_attempt_id = ?, attempt_count = attempt_count + 1"
        " WHERE id = ? AND state = 'queued'",
        [attempt_id, job_id],
    )
    db.execute("COMMIT")

    t = now()
    db.execute("BEGIN IMMEDIATE")
    stored, state, live = db.execute(
        "SELECT token_hash, state, lease_expires_at > ? FROM attempt WHERE id = ?", [t, attempt_id]
    ).fetchone()
    if stored != hashlib.sha256(token.encode()).hexdigest() or state != "active" or not live:
        raise RuntimeError("fencing failed")
    db.execute(
        "UPDATE attempt SET state = 'succeeded', finished_at = ? WHERE id = ? AND state = 'active'", [t, attempt_id]
    )
    db.execute(
        "UPDATE job SET state = 'succeeded', finished_at = ?, summary = '{}' WHERE id = ? AND state = 'leased'",
        [t, job_id],
    )
    db.execute("COMMIT")
    return True


def run(spec: dict) -> dict:
    jobs = spec["jobs"]
    with tempfile.TemporaryDirectory(prefix="apiary-bare-") as tmp:
        db = sqlite3.connect(os.path.join(tmp, "bare.db"), isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(SCHEMA)
        past = (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)).isoformat(" ")
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO job (key, state, priority, available_at, attempt_count) VALUES (?, 'queued', 0, ?, 0)",
            [(f"{i}:1:bench", past) for i in range(jobs)],
        )
        db.execute("COMMIT")
        done = 0
        started, cpu = time.perf_counter(), time.process_time()
        while lifecycle(db):
            done += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        db.close()
    if done != jobs:
        raise RuntimeError(f"bare sqlite3 finished {done} of {jobs} jobs")
    return {
        "jobs": jobs,
        "claim_finish_per_s": done / elapsed,
        "seconds": elapsed,
        "cpu_ms": cpu / jobs * 1000,
        "sqlite": sqlite3.sqlite_version,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)

"""Durable before acknowledged, with group commit: a process killed between a
grouped commit's batch and its answers loses no acknowledged finish.

A real child process (tests/queue/groupcommit_child.py) finishes claimed jobs
from several threads through one GroupCommitter and prints each finish the
moment it is answered. It is SIGKILLed while a commit that groups several
finishes has run its statements but not yet committed. Then the database,
opened afresh as after a restart, must hold every finish the child
acknowledged, and none of the killed batch's: a committer that answered
before its commit would have printed those, and they would be missing here.
"""

import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
JOBS, THREADS, HOLD_BATCH = 120, 8, 3


def _finished(database: dict[str, str]) -> set[int]:
    statement = "SELECT id FROM queue_attempt WHERE state = 'succeeded'"
    if "DATABASE_URL" in database:
        import psycopg

        with psycopg.connect(database["DATABASE_URL"]) as connect:
            return {row[0] for row in connect.execute(statement)}
    connect = sqlite3.connect(database["APIARY_DB_PATH"])  # a fresh connection: WAL recovery, as at a restart
    try:
        return {row[0] for row in connect.execute(statement)}
    finally:
        connect.close()


def test_a_kill_between_a_grouped_batch_and_its_answers_loses_no_acknowledged_finish(tmp_path, live_database_url):
    if live_database_url:
        database, extra = {"DATABASE_URL": live_database_url}, []
    else:
        database, extra = {"APIARY_DB_PATH": str(tmp_path / "queue.db")}, ["--migrate"]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "APIARY_DB_PATH")}
    env |= database | {
        "DJANGO_SETTINGS_MODULE": "apiary_site.settings",
        "APIARY_STATE_DIR": str(tmp_path),
        "APIARY_SQLITE_SYNCHRONOUS": "FULL",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "tests.queue.groupcommit_child", "--jobs", str(JOBS), "--threads", str(THREADS)]
    command += ["--hold-batch", str(HOLD_BATCH), *extra]
    stderr = (tmp_path / "child.stderr").open("w")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.SimpleQueue = queue.SimpleQueue()  # a reader thread: select() cannot see lines already buffered
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True).start()
    acked: set[int] = set()
    held: list[int] = []
    deadline = time.monotonic() + 120
    try:
        while not held:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                pytest.fail("the child ended or hung before a grouped commit:\n" + (tmp_path / "child.stderr").read_text()[-3000:])
            kind, *ids = line.split()
            if kind == "ACK":
                acked.add(int(ids[0]))
            elif kind == "HOLD":
                held = [int(i) for i in ids]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        while line := lines.get(timeout=30):  # what it printed before the kill, up to the end of its output
            if line.startswith("ACK "):
                acked.add(int(line.split()[1]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(held) > 1, "the held commit grouped several finishes"
    assert acked, "some finishes were answered before the kill"
    finished = _finished(database)
    assert acked <= finished, f"acknowledged but not in the database: {sorted(acked - finished)}"
    assert not set(held) & acked, "a finish of the uncommitted batch was answered"
    assert not set(held) & finished, "the killed batch was never committed"

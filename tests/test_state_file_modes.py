"""Local state is its owner's alone: `.apiary/` 0700; the queue database and
its -wal/-shm, worker histories, step logs and the secret key 0600, whatever
the umask — and state left with wider modes is tightened, with one warning
line naming the path and its old mode."""

import logging
import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from tests.daemon import run
from workers import private
from workers.localdb import LocalDB
from workflows import runners


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def permissive_umask():
    """The usual 022: without the fixes, files come out 0644 and directories 0755."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_a_database_made_private_keeps_its_wal_and_shm_private(tmp_path):
    db = private.private_sqlite(tmp_path / "apiary.db")
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        assert (tmp_path / "apiary.db-wal").exists() and (tmp_path / "apiary.db-shm").exists()
        assert {p.name: mode(p) for p in tmp_path.iterdir()} == {
            "apiary.db": 0o600, "apiary.db-wal": 0o600, "apiary.db-shm": 0o600,
        }  # fmt: skip
    finally:
        conn.close()


def test_a_worker_history_is_private(tmp_path):
    db = LocalDB(tmp_path / ".apiary" / "workers" / "w1.db")
    try:
        assert mode(tmp_path / ".apiary") == 0o700
        assert mode(tmp_path / ".apiary" / "workers") == 0o700
        for name in ("w1.db", "w1.db-wal", "w1.db-shm"):
            assert mode(tmp_path / ".apiary" / "workers" / name) == 0o600, name
    finally:
        db.close()


def test_a_wide_worker_history_is_tightened_with_a_warning(tmp_path, caplog):
    path = tmp_path / "workers" / "w1.db"
    LocalDB(path).close()
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="apiary.files"):
        LocalDB(path).close()
    assert mode(path) == 0o600
    assert [r.getMessage() for r in caplog.records] == [f"{path} was mode 0644 (readable by other users); now 0600"]


def test_a_step_log_is_private(tmp_path):
    log = tmp_path / "logs" / "7" / "work.log"
    result = runners.run_step(
        ["echo", "secret"], cwd=tmp_path, env={"PATH": os.environ["PATH"]}, stdin=None, log_path=log,
        timeout=30, cancel=threading.Event(),
    )  # fmt: skip
    assert result.status == "succeeded"
    assert mode(log) == 0o600 and mode(log.parent) == 0o700


def test_a_jobs_wide_log_folder_task_file_and_step_log_are_tightened_with_warnings(tmp_path, caplog):
    # run_step makes only a missing log folder: an existing one is the executor's to tighten, once
    # per job (made_private_dir in Executor.run), and each file by the descriptor it was opened with.
    from tests.test_executor import GRACE, make_claim, make_executor

    ex = make_executor(tmp_path, "echo out")
    logs = tmp_path / ".apiary" / "logs" / "5"
    logs.mkdir(parents=True)
    for name in ("task-1.json", "s1.log"):
        (logs / name).write_text("")
        (logs / name).chmod(0o644)
    logs.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="apiary.files"):
        outcome = ex.run(make_claim({"id": 7, "title": "t"}), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", outcome
    assert (mode(logs), mode(logs / "task-1.json"), mode(logs / "s1.log")) == (0o700, 0o600, 0o600)
    assert sorted(r.getMessage() for r in caplog.records) == sorted([
        f"{logs} was mode 0755 (readable by other users); now 0700",
        f"{logs / 'task-1.json'} was mode 0644 (readable by other users); now 0600",
        f"{logs / 's1.log'} was mode 0644 (readable by other users); now 0600",
    ])
    assert (logs / "s1.log").read_text() == "out\n"


@pytest.mark.processes
def test_apiary_run_makes_its_state_private_and_tightens_what_was_wide(tmp_path):
    config = tmp_path / "apiary.yaml"
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "a.md").write_text("# A\n")
    config.write_text(
        "project: modes\nagents:\n  - id: sh\n    runner: shell\n    command: cat\n"
        "workflows:\n  - id: job\n    agent: sh\n    steps:\n      - id: work\n        run: echo hi\n"
        "sources:\n  - id: inbox\n    type: directory\n    path: tasks\n    poll_interval: 0.3s\n    workflows: [job]\n"
    )
    first = run("runapiary", "--until-idle", config=config)
    assert first.returncode == 0, first.stdout + first.stderr
    state = tmp_path / ".apiary"
    logs = [p for p in (state / "logs").rglob("*") if p.is_file()]
    assert logs  # the step's log and task file
    assert mode(state) == 0o700
    assert mode(state / "apiary.db") == 0o600
    assert {p.name: mode(p) for p in logs} == {p.name: 0o600 for p in logs}
    assert "readable by other users" not in first.stderr

    # State from before this fix: the modes a 022 umask gave it.
    state.chmod(0o755)
    (state / "apiary.db").chmod(0o644)
    (state / "secret_key").write_text("k" * 60)
    (state / "secret_key").chmod(0o644)
    logs[0].chmod(0o644)
    second = run("runapiary", "--until-idle", config=config)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (mode(state), mode(state / "apiary.db"), mode(state / "secret_key"), mode(logs[0])) == (
        0o700, 0o600, 0o600, 0o600,
    )  # fmt: skip
    assert f"{state} was mode 0755 (readable by other users); now 0700" in second.stderr
    assert f"{state / 'apiary.db'} was mode 0644" in second.stderr
    assert f"{state / 'secret_key'} was mode 0644" in second.stderr
    assert "1 file(s) under" in second.stderr and f"{logs[0]}, mode 0644" in second.stderr

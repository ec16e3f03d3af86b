"""`apiary backup` and `apiary restore`, proven: a backup taken while jobs
finish holds every finish acknowledged before it began, passes
integrity_check and is 0600; a restore is refused while a daemon runs and
for a file that is not a sound Apiary database, and otherwise replaces the
database atomically, drops the old -wal/-shm and keeps the file 0600."""

import contextlib
import io
import sqlite3
import stat
import threading
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from jobqueue import services
from tests.daemon import Daemon, run, wait_for
from tests.factories import claim, enqueue, register

PROJECT = """\
project: restored
agents:
  - id: sh
    runner: shell
    command: cat
workflows:
  - id: job
    agent: sh
    steps:
      - id: work
        run: "true"
"""


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def rows(path: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return db.execute(sql).fetchall()


@pytest.fixture
def no_config(monkeypatch, tmp_path, queue_config, settings):
    monkeypatch.delenv("APIARY_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.django_db(transaction=True)
def test_a_backup_under_load_holds_every_finish_acknowledged_before_it(tmp_path, clock, no_config):
    if connection.vendor != "sqlite":
        pytest.skip("apiary backup copies SQLite; PostgreSQL is pg_dump's")
    worker = register("w1")  # claims one job, finishes it, claims the next
    jobs = [enqueue() for _ in range(400)]
    acked: list[int] = []
    stop = threading.Event()
    failures: list[BaseException] = []

    def finisher() -> None:  # a second connection finishing jobs throughout the backup
        try:
            while not stop.is_set():
                got = claim(worker)
                if not got:
                    break
                services.attempt_finish(attempt_id=got[0].attempt_id, token=got[0].token, outcome="succeeded")
                acked.append(got[0].job_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=finisher)
    thread.start()
    try:
        wait_for(lambda: len(acked) >= 30, timeout=60, what="finishes under way")
        before = list(acked)
        target = tmp_path / "backups" / "apiary.db"
        out = io.StringIO()
        call_command("backup", str(target), stdout=out)
        during = len(acked) - len(before)
    finally:
        stop.set()
        thread.join(60)
    assert not failures, failures
    assert during > 0, "no finish happened while the backup ran: the test proves nothing"
    assert rows(target, "PRAGMA integrity_check") == [("ok",)]
    assert rows(target, "PRAGMA journal_mode") == [("delete",)]  # one self-contained file
    assert mode(target) == 0o600
    succeeded = {job for (job,) in rows(target, "SELECT id FROM queue_job WHERE state = 'succeeded'")}
    assert set(before) <= succeeded
    assert len(rows(target, "SELECT id FROM queue_job")) == len(jobs)
    # Nothing half-copied: each job's state and its attempt's agree.
    assert rows(
        target,
        "SELECT count(*) FROM queue_job j JOIN queue_attempt a ON a.job_id = j.id "
        "WHERE (j.state = 'succeeded') != (a.state = 'succeeded')",
    ) == [(0,)]
    assert [p.name for p in target.parent.iterdir()] == ["apiary.db"]  # no draft left
    assert "integrity_check ok" in out.getvalue()


def test_backup_refuses_to_overwrite(tmp_path, no_config):
    if connection.vendor != "sqlite":
        pytest.skip("apiary backup copies SQLite; PostgreSQL is pg_dump's")
    (tmp_path / "there.db").write_text("x")
    with pytest.raises(CommandError, match="exists; refusing to overwrite it"):
        call_command("backup", str(tmp_path / "there.db"))


# --------------------------------------------------------------------------- restore (real processes)


@pytest.fixture
def project(tmp_path) -> Path:
    config = tmp_path / "apiary.yaml"
    config.write_text(PROJECT)
    done = run("runapiary", "--until-idle", config=config)  # migrates, and nothing to do
    assert done.returncode == 0, done.stdout + done.stderr
    return config


def tasks_in(db: Path) -> int:
    return rows(db, "SELECT count(*) FROM workflows_task")[0][0]


def add_task(config: Path, title: str) -> None:
    added = run("task", "add", "--title", title, "--workflow", "job", config=config)
    assert added.returncode == 0, added.stdout + added.stderr


@pytest.mark.processes
def test_restore_replaces_the_database_and_drops_its_stale_wal(project, tmp_path):
    db = tmp_path / ".apiary" / "apiary.db"
    backup = tmp_path / "b.db"
    assert run("backup", str(backup), config=project).returncode == 0
    before = tasks_in(db)
    add_task(project, "made after the backup")
    assert tasks_in(db) == before + 1
    # A -wal and -shm left behind by the old database: replayed into the new one, they would corrupt it.
    Path(f"{db}-wal").write_bytes(b"\x37\x7f\x06\x82" + b"\x00" * 60)
    Path(f"{db}-shm").write_bytes(b"\x00" * 64)

    restored = run("restore", str(backup), config=project)
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert not Path(f"{db}-wal").exists() and not Path(f"{db}-shm").exists()
    assert tasks_in(db) == before
    assert rows(db, "PRAGMA integrity_check") == [("ok",)]
    assert mode(db) == 0o600
    kept = tmp_path / ".apiary" / "apiary.db.before-restore"
    assert f"the previous database is kept at {kept}" in restored.stdout
    assert tasks_in(kept) == before + 1 and mode(kept) == 0o600
    add_task(project, "the restored database takes writes")  # and Apiary opens it
    assert tasks_in(db) == before + 1


@pytest.mark.processes
def test_restore_is_refused_while_a_daemon_runs(project, tmp_path):
    backup = tmp_path / "b.db"
    assert run("backup", str(backup), config=project).returncode == 0
    daemon = Daemon(project)
    try:
        lock = tmp_path / ".apiary" / "daemon.lock"
        # Its lock names it once taken (a worker row proves nothing: the fixture's own run left one).
        wait_for(
            lambda: lock.exists() and f"pid {daemon.pid}," in lock.read_text(),
            timeout=60, what="the daemon to hold the state directory", daemon=daemon,
        )  # fmt: skip
        refused = run("restore", str(backup), config=project)
        assert refused.returncode == 1
        assert f"refusing to restore: {tmp_path / '.apiary'} is in use by apiary run pid {daemon.pid}" in refused.stderr
        assert not (tmp_path / ".apiary" / "apiary.db.before-restore").exists()
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


@pytest.mark.processes
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"just text\n", ("not a SQLite database",)),
        ("other", ("not an Apiary database (no django_migrations, queue_job, queue_attempt table)",)),
        ("torn", ("fails PRAGMA integrity_check", "database disk image is malformed")),  # where the damage lies
    ],
)
def test_restore_refuses_a_file_that_is_not_a_sound_apiary_database(project, tmp_path, content, expected):
    db = tmp_path / ".apiary" / "apiary.db"
    candidate = tmp_path / "candidate.db"
    if content == "other":
        with contextlib.closing(sqlite3.connect(candidate)) as other:
            other.execute("CREATE TABLE notes (x)")
            other.commit()
    elif content == "torn":
        assert run("backup", str(candidate), config=project).returncode == 0
        data = bytearray(candidate.read_bytes())
        page = 4096
        for offset in range(2 * page, len(data) - page, 3 * page):  # scribble over interior pages
            data[offset + 8 : offset + 200] = b"\xa5" * 192
        candidate.write_bytes(bytes(data))
    else:
        candidate.write_bytes(content)
    original = db.read_bytes()
    refused = run("restore", str(candidate), config=project)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert any(e in refused.stderr for e in expected) and "nothing restored" in refused.stderr
    assert db.read_bytes() == original


# --------------------------------------------------------------------------- restore (in process)


def apiary_like(path: Path, *, wal: bool = False) -> sqlite3.Connection:
    """A database with the tables `problem_with` looks for, and one row of queue_job."""
    db = sqlite3.connect(path)
    if wal:
        db.execute("PRAGMA journal_mode=WAL")
    for table in ("django_migrations", "queue_job", "queue_attempt"):
        db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, note TEXT)")
    db.execute("INSERT INTO queue_job (note) VALUES ('in the main file')")
    db.commit()
    return db


def test_restore_is_refused_when_another_connection_keeps_the_wal_from_being_checkpointed(tmp_path, monkeypatch):
    # Another process with the database open (an `apiary status`, a sqlite3 shell): the
    # daemon lock does not stop it. Its read transaction keeps TRUNCATE from completing, so
    # the kept copy would lack what is only in the WAL, and the WAL is deleted next.
    from apiary_site import sqlitefiles

    monkeypatch.setattr(sqlitefiles, "BUSY_TIMEOUT", 0.1)
    backup = tmp_path / "b.db"
    apiary_like(backup).close()
    database = tmp_path / "apiary.db"
    writer = apiary_like(database, wal=True)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("INSERT INTO queue_job (note) VALUES ('only in the WAL')")
    writer.commit()
    reader = sqlite3.connect(database, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM queue_job").fetchone() == (2,)  # holds its snapshot
        wal = Path(f"{database}-wal")
        assert wal.stat().st_size, "nothing in the WAL: the test proves nothing"
        with pytest.raises(sqlitefiles.CopyError, match="another process has .* open .* stop it .* and retry"):
            sqlitefiles.replace(database, backup)
        # The database stays in place with its WAL (the checkpoint may have copied some of it
        # into the main file: the same data); no kept copy, no incoming copy left behind.
        assert sorted(p.name for p in tmp_path.iterdir()) == ["apiary.db", "apiary.db-shm", "apiary.db-wal", "b.db"]
    finally:
        reader.close()
        writer.close()
    assert rows(database, "SELECT note FROM queue_job ORDER BY id") == [("in the main file",), ("only in the WAL",)]
    # Once the other connections are gone the same restore goes through and keeps everything.
    kept = sqlitefiles.replace(database, backup)
    assert rows(kept, "SELECT note FROM queue_job ORDER BY id") == [("in the main file",), ("only in the WAL",)]
    assert rows(database, "SELECT note FROM queue_job") == [("in the main file",)]

"""Helpers for end-to-end tests that run the real `apiary` commands as subprocesses.

Commands run as `python manage.py COMMAND …` with the interpreter running the
tests, so they work from a fresh clone whether or not the `apiary` console
script is on PATH (manage.py goes through `apiary_site.cli` like the script).
Their environment is scrubbed of APIARY_* / DJANGO_* / DATABASE_URL so the
state always lands in `<config dir>/.apiary/apiary.db`, which the tests read
with plain sqlite3 — never through Django, whose connection belongs to pytest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import waiting
from workers import pgroups

REPO = Path(__file__).resolve().parent.parent
MANAGE = REPO / "manage.py"
POLL = 0.05  # how often conditions are re-checked while waiting


def command(*args: str) -> list[str]:
    return [sys.executable, str(MANAGE), *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("APIARY_", "DJANGO_")) and name != "DATABASE_URL"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def apiary_command(*args: str) -> list[str]:
    """`apiary ARGS…` as a user types it: through the console script's router
    (apiary_site.cli), with argv[0] `apiary`. -P: the working directory (a fresh
    project folder) never shadows the packages; clean_env's PYTHONPATH finds them."""
    return [sys.executable, "-P", "-c", "import sys; sys.argv[0] = 'apiary'; from apiary_site.cli import main; main()", *args]


def apiary(*args: str, cwd: Path, timeout: float = 60.0, **env: str) -> subprocess.CompletedProcess:
    """Run `apiary ARGS…` in `cwd` to its end, with `env` added to a clean environment."""
    return subprocess.run(
        apiary_command(*args), cwd=cwd, env=clean_env(PYTHONPATH=str(REPO), **env),
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def run(*args: str, config: Path, timeout: float = 60.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run one command to its end (`run("status", "--json", config=cfg)`)."""
    return subprocess.run(
        command(*args, "--config", str(config)),
        cwd=cwd or config.parent,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, daemon: Daemon | None = None) -> Any:
    """`tests.waiting.wait_for` for a daemon's database: poll `predicate`
    until it returns something truthy (returned); an AssertionError after
    `timeout` seconds, or at once if `daemon` exits meanwhile, with its
    output's tail. A database that is not there yet or is busy counts as
    "not yet"."""

    def condition() -> Any:
        try:
            value = predicate()
        except sqlite3.OperationalError:
            value = None
        if not value and daemon is not None and daemon.proc.poll() is not None:
            raise AssertionError(
                f"the daemon exited ({daemon.proc.returncode}) while waiting for {what}\n{daemon.tail()}"
            )
        return value

    return waiting.wait_for(
        condition, timeout=timeout, what=what, step=POLL, on_timeout=daemon.tail if daemon is not None else None
    )


class Database:
    """Read-only queries on a project's SQLite file, one short connection each."""

    def __init__(self, path: Path):
        self.path = path

    def rows(self, sql: str, *params: Any) -> list[sqlite3.Row]:
        if not self.path.exists():  # connecting would create an empty file
            raise sqlite3.OperationalError(f"{self.path} does not exist yet")
        with contextlib.closing(sqlite3.connect(self.path, timeout=10)) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()

    def value(self, sql: str, *params: Any) -> Any:
        rows = self.rows(sql, *params)
        return rows[0][0] if rows else None


class Daemon:
    """`apiary run` in the background, its output (stdout + stderr) in a file."""

    def __init__(self, config: Path, *args: str, cwd: Path | None = None):
        self.config = config
        self.log_path = config.parent / f"daemon-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()/stop()
        # Its own session: signals are sent to this pid only, never to the test's group.
        self.proc = subprocess.Popen(
            command("runapiary", "--config", str(config), *args),
            cwd=cwd or config.parent,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "--- daemon output (tail) ---\n" + "\n".join(self.output().splitlines()[-lines:])

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the daemon did not exit within {timeout:g}s\n{self.tail()}") from None
        self._log.close()
        return code

    def stop(self) -> None:
        """Teardown: SIGKILL if still running (the test has failed by then)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


# ----------------------------------------------------------------------------- process groups


def recorded_groups(state_dir: Path, worker_id: str = "embedded") -> list[int]:
    """The process groups a worker recorded in `.apiary/run/<worker-id>/` and not as ended."""
    return sorted(pgroups.recorded(state_dir / "run" / worker_id))


def group_alive(pgid: int) -> bool:
    """True while a live process of the group exists.

    `os.killpg(pgid, 0)` succeeding is not enough: an orphaned step (its
    daemon was SIGKILLed) is re-parented to PID 1, and inside some containers
    PID 1 never reaps, so a killed orphan stays a zombie forever. A zombie
    runs nothing, so only members in another state count."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, …
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False


def kill_groups(pgids: list[int]) -> None:
    """Teardown: SIGKILL step groups a failed test may have left running."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

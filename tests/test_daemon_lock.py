"""One daemon per state directory: a second `apiary run` on the same
`.apiary/` exits non-zero naming the running one, which carries on; a daemon
that died (even by SIGKILL) leaves no lock behind."""

import os
import re
import signal
import stat

import pytest

from apiary_site.statelock import StateLock, StateLocked
from tests.daemon import Daemon, Database, run, wait_for

PROJECT = """\
project: locked
settings:
  queue:
    lease_duration: 3s
    heartbeat_interval: 0.5s
    worker_timeout: 3s
"""


def test_the_lock_names_its_holder_and_is_private(tmp_path):
    lock = StateLock.acquire(tmp_path / ".apiary")
    try:
        text = (tmp_path / ".apiary" / "daemon.lock").read_text()
        assert re.fullmatch(rf"apiary run pid {os.getpid()}, started \d{{4}}-\d\d-\d\dT[\d:]+\+00:00\n", text)
        assert stat.S_IMODE((tmp_path / ".apiary" / "daemon.lock").stat().st_mode) == 0o600
        with pytest.raises(StateLocked, match=f"in use by apiary run pid {os.getpid()}, started "):
            StateLock.acquire(tmp_path / ".apiary")  # another open file: flock refuses it even in this process
    finally:
        lock.release()
    StateLock.acquire(tmp_path / ".apiary").release()  # released: free again


@pytest.mark.processes
def test_a_second_daemon_on_the_same_state_directory_is_refused(tmp_path):
    config = tmp_path / "apiary.yaml"
    config.write_text(PROJECT)
    first = Daemon(config)
    try:
        # Up: the embedded worker registered (so the lock was taken long before).
        wait_for(
            lambda: Database(tmp_path / ".apiary" / "apiary.db").value("SELECT count(*) FROM queue_worker"),
            timeout=60,
            what="the first daemon's embedded worker",
            daemon=first,
        )
        second = run("runapiary", "--until-idle", config=config)
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"is in use by apiary run pid {first.pid}, started " in second.stderr
        assert first.proc.poll() is None  # the first one carries on, not superseded
        assert "superseded" not in first.output()

        first.send(signal.SIGKILL)  # a crash: no cleanup runs
        first.wait(30)
        third = run("runapiary", "--until-idle", config=config)
        assert third.returncode == 0, third.stdout + third.stderr
    finally:
        first.stop()

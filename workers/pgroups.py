"""A worker's record of the process groups its steps run in.

Every step runs in its own process group. The worker writes the group id
(with its leader's start time) to `.apiary/run/<worker-id>/<pgid>` before the
step can do anything and removes it when the step ends, so when a worker (or
the daemon embedding it) is SIGKILLed, its successor finds the groups left
behind and ends them before the job runs again: two copies of one step never
run side by side.
"""

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("apiary.worker")

POLL = 0.05  # how often a group's end is checked while waiting for it
KILL_WAIT = 5.0  # how long to wait for a SIGKILLed group to disappear before giving up


class ProcessGroups:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, pgid: int) -> None:
        started = process_start_time(pgid)
        (self.directory / str(pgid)).write_text("" if started is None else str(started))

    def remove(self, pgid: int) -> None:
        (self.directory / str(pgid)).unlink(missing_ok=True)

    def reap_orphans(self, *, grace: float = 5.0) -> list[int]:
        """End every recorded group still alive; returns the ones ended. A group
        whose leader is alive but started at another time is someone else's
        (a reused pid) and is left alone."""
        ended = []
        for entry in sorted(self.directory.iterdir()):
            if not entry.name.isdigit():
                continue
            pgid, recorded = int(entry.name), entry.read_text().strip()
            if process_group_alive(pgid):
                log.warning("ending process group %s left behind by a previous worker process", pgid)
                if kill_process_group(pgid, grace, leader_started=int(recorded) if recorded else None):
                    ended.append(pgid)
            entry.unlink(missing_ok=True)
        return ended


def kill_process_group(pgid: int, grace: float = 5.0, *, leader_started: int | None = None) -> bool:
    """SIGTERM the group, SIGKILL it after `grace` seconds; True once no live
    process of it is left.

    `leader_started` (from `process_start_time`, recorded at spawn) guards a
    successor against PID reuse: if the group's leader is alive but started
    at another time, the group is someone else's and is left alone (False)."""
    if leader_started is not None:
        started = process_start_time(pgid)
        if started is not None and started != leader_started:
            return False
    if not signal_group(pgid, signal.SIGTERM):
        return True
    deadline = time.monotonic() + grace
    while process_group_alive(pgid):
        if time.monotonic() >= deadline:
            signal_group(pgid, signal.SIGKILL)
            return _wait_group_gone(pgid, KILL_WAIT)
        time.sleep(POLL)
    return True


def process_group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process of the group exists.

    Zombies are ignored: an orphan's zombie waits for init to reap it, which
    some inits do late or never, and a zombie runs nothing."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it is just not ours to signal
    members = _group_states(pgid)
    if members is None:  # no /proc: trust the signal probe
        return True
    return any(state not in "ZX" for state in members)


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None."""
    stat = _read_stat(pid)
    return int(stat[19]) if stat else None


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while process_group_alive(pgid):
        if time.monotonic() >= deadline:
            log.error("process group %s still has live processes after SIGKILL", pgid)
            return False
        time.sleep(POLL)
    return True


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not permitted to signal process group %s", pgid)
    return True


def _read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 = state)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _group_states(pgid: int) -> list[str] | None:
    """States of the processes in group `pgid`, or None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    states = []
    for name in entries:
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat and int(stat[2]) == pgid:
                states.append(stat[0])
    return states

"""A worker's record of the process groups its steps run in.

Every step runs in its own process group. The worker writes the group id to
`.apiary/run/<worker-id>/<pgid>` before the step can do anything and removes
it when the step ends, so when a worker (or the daemon embedding it) is
SIGKILLed, its successor finds the groups left behind and ends them before
the job runs again: two copies of one step never run side by side.
"""

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("apiary.worker")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid it names one process for good, so a reused pid is never mistaken for ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessGroups:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, pgid: int) -> None:
        (self.directory / str(pgid)).write_text(_start_time(pgid) or "")

    def remove(self, pgid: int) -> None:
        (self.directory / str(pgid)).unlink(missing_ok=True)

    def reap_orphans(self, *, grace: float = 5.0) -> list[int]:
        """End every recorded group that is still alive; returns the ones signalled."""
        ended = []
        for entry in sorted(self.directory.iterdir()):
            if not entry.name.isdigit():
                continue
            pgid = int(entry.name)
            recorded = entry.read_text().strip()
            leader = _start_time(pgid)
            # The leader may be gone while children remain; a pgid is never handed
            # to a new process while its group exists, so the group is still ours.
            if group_alive(pgid) and (leader is None or not recorded or leader == recorded):
                log.warning("ending process group %s left behind by a previous worker process", pgid)
                terminate_group(pgid, grace=grace)
                ended.append(pgid)
            entry.unlink(missing_ok=True)
        return ended


def terminate_group(pgid: int, *, grace: float) -> None:
    """SIGTERM the group, SIGKILL it after `grace` seconds if anything is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)

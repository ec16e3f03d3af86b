"""A worker's record of the process groups its steps run in.

Every step runs in its own process group. The worker writes the group id
(with its leader's start time) to `.apiary/run/<worker-id>/<pgid>` before the
step can do anything and removes it when the step ends, so when a worker (or
the daemon embedding it) is SIGKILLed, its successor finds the groups left
behind and ends them before the job runs again: two copies of one step never
run side by side.
"""

import logging
from pathlib import Path

from workflows.runners import kill_process_group, process_group_alive, process_start_time

log = logging.getLogger("apiary.worker")


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

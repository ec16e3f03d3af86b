"""The operator's side of a real control plane, for the browser tests.

`Console` is a `tests.remote.conftest.ControlPlane` (`apiary run` serving the
worker protocol and the admin on a free loopback port, SQLite beside its
apiary.yaml) with a superuser, plus `seed()`: one remote `apiary worker`
(pool alpha, capacity 1) and a queue an operator would want to look at:

    failed     "failing report"   alpha-fail    its step printed a line and exited 3
    running    "long build"       alpha-chatty  leased by worker alpha-1, printing, held at its gate
    queued     "queued one/two"   alpha-quick   backlog behind the busy worker (status: "… at capacity")
    blocked    "needs beta"       beta-quick    no worker in pool beta
    blocked    "to be cancelled"  beta-quick    the same, kept for a test to cancel

Tasks arrive as files of directory sources (no process per task); nothing
else changes the queue but `apiary` commands and the worker. Tests that
change the seed (a cancel, a retry) change jobs kept for them, or read the
counts they compare against from `console.status()` in the same test.
Nothing is left running: the gate of "long build" is never
opened, the worker is killed with its step's process group at the end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.remote.conftest import ALPHA, ControlPlane, Workers, wait_for

USERNAME = "operator"
PASSWORD = "browser-tests-password-7c41"  # a throwaway control plane's; never a real one
WORKER_ID = "alpha-1"

# A step that says something while it runs, then waits for its gate: the
# running job of the seed (and the one whose log tail a test can read).
CHATTY = r"""
for part in 1 2 3; do echo "compiling part $part of 3"; done
while [ ! -e "$GATES/$APIARY_TASK_TITLE" ]; do sleep 0.05; done
echo "done"
"""
FAILING = r"""
echo "report generator: input is empty" >&2
exit 3
"""


# A directory source per kind of job: seeding writes files (the daemon polls every
# 0.5s) instead of running one `apiary task add` process per job.
SOURCES = {"failing": "alpha-fail", "builds": "alpha-chatty", "backlog": "alpha-quick", "beta-inbox": "beta-quick"}


def _add_workflows_and_sources(config: dict) -> None:
    """Two workflows of agent alpha besides the remote suite's own (which never fail
    nor print while held), and the seed's sources."""
    for name, run in (("alpha-chatty", CHATTY), ("alpha-fail", FAILING)):
        config["workflows"].append({"id": name, "agent": "alpha", "steps": [{"id": "work", "run": run, "timeout": "120s"}]})
    for source, workflow in SOURCES.items():
        config["sources"].append({"id": source, "type": "directory", "path": source, "pattern": "*.md",
                                  "poll_interval": "0.5s", "workflows": [workflow]})


@dataclasses.dataclass(frozen=True)
class Seeded:
    """Job ids of the seeded queue (see the module docstring)."""

    failed: int
    running: int
    queued: tuple[int, ...]
    blocked: int
    to_cancel: int
    instances: dict[int, int]  # job id -> workflow instance id (what `apiary cancel/retry/logs` take)
    worker_id: str = WORKER_ID

    def all(self) -> tuple[int, ...]:
        return (self.failed, self.running, *self.queued, self.blocked, self.to_cancel)


class Console(ControlPlane):
    """A control plane whose admin a browser can log in to."""

    def __init__(self, root: Path):
        for source in SOURCES:
            (root / source).mkdir(parents=True, exist_ok=True)
        super().__init__(root, edit_config=_add_workflows_and_sources)
        self.admin = f"{self.url}/admin/"
        self.workers = Workers(self)

    def start(self) -> None:
        super().start()
        # APIARY_CONFIG rather than --config: Django's createsuperuser has no such flag.
        self.cli("createsuperuser", "--noinput", "--username", USERNAME, "--email", "operator@example.com",
                 config=False, env={"APIARY_CONFIG": str(self.config), "DJANGO_SUPERUSER_PASSWORD": PASSWORD})

    def stop(self) -> int:
        self.workers.close()
        return super().stop()

    def admin_url(self, path: str = "") -> str:
        """`/admin/` + path, e.g. admin_url("queue/job/")."""
        return self.admin + path.lstrip("/")

    def job_id(self, title: str, workflow: str, state: str | tuple[str, ...] = ()) -> int:
        """The job of a task's workflow, once it exists (and is in `state`, when given)."""
        states = (state,) if isinstance(state, str) else state

        def ready():
            job = self.job(title, workflow)
            return job["id"] if job and (not states or job["state"] in states) else None

        return wait_for(ready, what=f"the {workflow} job of {title!r}{' to be ' + '/'.join(states) if states else ''}",
                        alive=(self.proc,), context=self.tail)

    def seed(self) -> Seeded:
        """Start worker alpha-1 and build the queue of the module docstring, one stage at a
        time so that each job is where it should be before the next is added."""
        [worker] = self.workers.start((WORKER_ID, ALPHA))
        self.add("failing", "failing report")
        failed = self.job_id("failing report", "alpha-fail", "failed")
        self.add("builds", "long build")
        running = self.job_id("long build", "alpha-chatty", "leased")
        wait_for(lambda: any(a["worker_id"] == WORKER_ID and a["state"] == "active" for a in self.attempts(running)),
                 what="long build's attempt on alpha-1", alive=(self.proc, worker.proc), context=worker.tail)
        for source, title in (("backlog", "queued one"), ("backlog", "queued two"), ("beta-inbox", "needs beta"),
                              ("beta-inbox", "to be cancelled")):
            self.add(source, title)
        queued = tuple(self.job_id(title, "alpha-quick", "queued") for title in ("queued one", "queued two"))
        blocked = self.job_id("needs beta", "beta-quick", "queued")
        to_cancel = self.job_id("to be cancelled", "beta-quick", "queued")
        ids = (failed, running, *queued, blocked, to_cancel)
        return Seeded(failed=failed, running=running, queued=queued, blocked=blocked, to_cancel=to_cancel,
                      instances={job_id: self.instance_id(job_id) for job_id in ids})

    def instance_id(self, job_id: int) -> int:
        return self.value("SELECT id FROM workflows_workflowinstance WHERE job_id = ?", job_id)

    def add(self, source: str, title: str) -> None:
        """A task of one of SOURCES, as a file named after its title."""
        self.drop_file(source, title.replace(" ", "-") + ".md", title)

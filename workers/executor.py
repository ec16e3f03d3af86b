"""What the runtime runs a claimed job through: the Executor protocol this
layer defines and workflows.executor.Executor implements, and its Outcome."""

import dataclasses
import threading
from typing import Protocol

from jobqueue.types import Claim

from .journal import Journal


@dataclasses.dataclass(frozen=True)
class Outcome:
    outcome: str  # succeeded | failed | cancelled
    summary: dict
    error: str | None = None


class Executor(Protocol):
    """What runs a claimed job (workflows.executor.Executor). `cancel` is set
    when the job must stop (a cancel request, self-fencing, a second signal);
    `grace` is how long a stopped step may take between SIGTERM and SIGKILL;
    `journal` is the job's journal, bound to the claim's attempt (workers/journal.py)."""

    def run(self, claim: Claim, cancel: threading.Event, *, grace: float, journal: Journal) -> Outcome: ...

"""The embedded worker: the same runtime as a remote worker, on the in-process transport."""

from workflows import runners
from workflows.config import Config

from .executor import Executor
from .history import DatabaseHistory
from .pgroups import ProcessGroups
from .runtime import WorkerRuntime
from .transport import InProcessTransport, WorkerSpec

EMBEDDED_ID = "embedded"


def capabilities_for(adapters: set[str], extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A worker advertises `runner:<adapter>` only for adapters whose executable it finds."""
    return tuple(sorted({"apiary.workflow", *(f"runner:{a}" for a in adapters), *extra}))


def embedded_runtime(config: Config, *, grace: float = 5.0) -> WorkerRuntime:
    groups = ProcessGroups(config.state_dir / "run" / EMBEDDED_ID)
    groups.reap_orphans(grace=grace)  # steps a SIGKILLed predecessor left running
    spec = WorkerSpec(
        worker_id=EMBEDDED_ID,
        pool=None,
        labels=(),
        capabilities=capabilities_for(runners.available_adapters()),
        capacity=config.settings.worker_capacity,
        embedded=True,
    )
    executor = Executor(config=config, worker_id=EMBEDDED_ID, history=DatabaseHistory(), groups=groups, grace=grace)
    return WorkerRuntime(
        transport=InProcessTransport(worker_id=EMBEDDED_ID),
        spec=spec,
        executor=executor,
        claim_wait=min(1.0, config.settings.queue.heartbeat_interval / 2),
        exit_on_drain=False,  # an operator's drain pauses it; undrain resumes it; only the daemon stops it
    )

"""`apiary run` as an object: the control plane, the embedded worker and the
worker-protocol listener, and the loop that keeps them going.

`Daemon.run_once()` does one round (poll, dispatch, reap; check the embedded
worker and the listener; decide whether `--until-idle` is done) and returns
whether to go on; `run()` loops it until a signal or an exit condition, then
drains. The `runapiary` command only parses arguments, wires a Daemon and
installs its signal handlers.
"""

import dataclasses
import logging
import subprocess
import threading

from jobqueue.exceptions import Unavailable
from jobqueue.types import EMBEDDED_ID
from workers.pgroups import ProcessGroups
from workers.runtime import WorkerRuntime
from workers.signals import Signals
from workers.transport import InProcessTransport, WorkerSpec

from . import runners
from .config import Config
from .controlplane import ControlPlane
from .executor import Executor
from .history import DatabaseHistory
from .services import worker_capabilities

log = logging.getLogger("apiary.controlplane")

EXIT_FATAL = 1  # the embedded worker or the listener died
EXIT_STUCK = 3  # --until-idle: queued jobs that can never run as configured


def embedded_runtime(config: Config, *, grace: float = 5.0) -> WorkerRuntime:
    """The embedded worker: the same runtime as a remote worker, on the in-process transport."""
    groups = ProcessGroups(config.state_dir / "run" / EMBEDDED_ID)
    groups.reap_orphans(grace=grace)  # steps a SIGKILLed predecessor left running
    spec = WorkerSpec(
        worker_id=EMBEDDED_ID,
        pool=None,
        labels=(),
        capabilities=worker_capabilities(runners.available_adapters()),
        capacity=config.settings.worker_capacity,
        embedded=True,
    )
    transport = InProcessTransport(worker_id=EMBEDDED_ID)
    history = DatabaseHistory(committer=transport.committer)  # step rows ride the worker's own commits
    return WorkerRuntime(
        transport=transport,
        spec=spec,
        executor=Executor(config=config, worker_id=EMBEDDED_ID, history=history, groups=groups),
        claim_wait=min(1.0, config.settings.queue.heartbeat_interval / 2),
        grace=grace,
        exit_on_drain=False,  # an operator's drain pauses it; undrain resumes it; only the daemon stops it
    )


@dataclasses.dataclass
class Daemon:
    config: Config
    control: ControlPlane
    runtime: WorkerRuntime | None = None  # the embedded worker, unless configured off
    listener: subprocess.Popen | None = None  # gunicorn serving the worker protocol
    until_idle: bool = False
    signals: Signals = dataclasses.field(default_factory=Signals)
    exit_code: int = 0
    _thread: threading.Thread | None = None
    _stuck_before: list = dataclasses.field(default_factory=list)

    def start(self) -> None:
        if self.runtime is not None:
            self.runtime.start()
            self._thread = threading.Thread(target=self.runtime.run, name="embedded-worker", daemon=True)
            self._thread.start()
        else:
            log.info("embedded worker off (settings.queue.embedded_worker: false): jobs wait for remote workers")

    def run_once(self) -> bool:
        """One round; False once the daemon should stop (see `exit_code`)."""
        try:
            self.control.run_once()
        except Unavailable as exc:
            log.warning("database busy: %s", exc)
        if self.runtime is not None and self.runtime.fatal:
            self.exit_code = EXIT_FATAL
            return False
        if self.listener is not None and self.listener.poll() is not None:
            log.error("the worker protocol listener exited with code %s; stopping", self.listener.returncode)
            self.exit_code = EXIT_FATAL
            return False
        return not (self.until_idle and self._idle_or_stuck())

    def _idle_or_stuck(self) -> bool:
        if not self.control.polled >= set(self.config.sources) or (self.runtime is not None and not self.runtime.idle()):
            return False
        if self.control.idle():
            log.info("idle: every source polled, no job queued or leased")
            for source_id in sorted(self.control.failed_sources()):
                log.warning("source %s failed its last poll: its items may be missing", source_id)
            return True
        stuck = self.control.stuck()
        if stuck and stuck == self._stuck_before:  # the same verdict twice in a row, not a passing state
            for job in stuck:
                log.error("blocked: job %s: %s", job["job_id"], job["reason"])
            log.error("--until-idle: %d queued job(s) can never run as configured; exiting 3", len(stuck))
            self.exit_code = EXIT_STUCK
            return True
        self._stuck_before = stuck
        return False

    def run(self, *, tick: float = 0.2) -> int:
        """Start, then loop `run_once` until it says stop or a signal comes;
        then drain the embedded worker (a second signal stops its jobs) and
        stop the listener. Returns the exit code."""
        try:
            self.start()
            while not self.signals.received.is_set() and self.run_once():
                self.signals.received.wait(tick)
            self.signals.act(self.runtime)
            if self.runtime is not None:
                self.runtime.request_drain("shutting down")
                while self._thread.is_alive():
                    self._thread.join(0.1)
                    self.signals.act(self.runtime)
        finally:
            self.stop_listener()
        return self.exit_code

    def stop_listener(self) -> None:
        if self.listener is not None and self.listener.poll() is None:
            self.listener.terminate()  # gunicorn: graceful stop of its workers
            try:
                self.listener.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.listener.kill()

"""A running job's journal, as its executor uses it: records written through
the claim's attempt token (jobqueue/services/records.py says the rules), and
the checkpoint file the runtime's heartbeats carry.

The runtime makes one `Journal` per claimed job and passes it to the
executor. A call the control plane answers as stale (or a superseded
session, a refused credential) means the attempt is no longer current: the
journal tells the runtime (`on_refused`, which discards the job's result as
for a stale heartbeat) and raises `JournalError` with `current=False`, so the
executor runs nothing more. A call that fails for want of the control plane
is sent again (a record is safe to resend) until it answers or the job is
stopped (`cancel`: a self-fence, a cancel request).
"""

import dataclasses
import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path

from jobqueue.exceptions import QueueError
from jobqueue.types import MAX_CHECKPOINT_BYTES, Claim, Record

from .backoff import Backoff
from .transport import Transport
from .verdicts import Verdict, classify

log = logging.getLogger("apiary.worker")

JOURNAL_BACKOFF = {"base": 0.2, "cap": 5.0}  # seconds between resends while the control plane is unavailable


class JournalError(Exception):
    """A journal call that did not happen. `current` is False when the control
    plane no longer considers the attempt current: nothing more may run."""

    def __init__(self, message: str, *, current: bool):
        super().__init__(message)
        self.current = current


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The checkpoint file of the step that is running: heartbeats send its latest content."""

    step: str
    path: Path


def checkpoint_content(path: Path) -> str | None:
    """The file's content as a checkpoint carries it: UTF-8 text of at most
    MAX_CHECKPOINT_BYTES bytes (a longer file is cut at a character boundary;
    bytes that are not UTF-8 become U+FFFD); None when there is no file."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CHECKPOINT_BYTES + 1)
    except OSError:
        return None
    text = data.decode("utf-8", errors="replace")
    encoded = text.encode("utf-8", errors="surrogatepass")
    if len(encoded) > MAX_CHECKPOINT_BYTES:
        text = encoded[:MAX_CHECKPOINT_BYTES].decode("utf-8", errors="ignore")
    return text


class Journal:
    def __init__(
        self,
        *,
        transport: Transport,
        claim: Claim,
        cancel: threading.Event,
        on_refused: Callable[[Verdict, QueueError], None] = lambda verdict, exc: None,
        sleep: Callable[[float], None] | None = None,
        rand: Callable[[], float] = random.random,
        finish_carries: bool = False,
    ):
        self.transport = transport
        # The runtime's finish carries the job's last record (record_before_finish).
        self.finish_carries = finish_carries
        self.before_finish: dict | None = None  # what record_before_finish kept: the finish's `record`
        self.claim = claim
        self.cancel = cancel
        self.on_refused = on_refused  # the runtime: discard the job (stale), or stop (superseded, unauthorized)
        self.sleep = sleep or cancel.wait  # a resend's wait, which a stop ends early; tests pass a fake one
        self.rand = rand
        # Set by the executor while a step runs; read by the runtime's heartbeat thread.
        self.checkpoint: Checkpoint | None = None
        self.sent: tuple[str, str] | None = None  # (step, content) the control plane last kept
        # The job's log sender (workers/logstream.py) when the control plane takes logs; the
        # executor tells it where each step's output begins and ends.
        self.logs = None

    def record(self, key: str, state: str, value: dict) -> Record:
        """Write `key` = `state` (`value`); the record as the control plane answers it."""
        fence = {"attempt_id": self.claim.attempt_id, "token": self.claim.token}
        return self._call(f"record {key}", lambda: self.transport.record(**fence, key=key, state=state, value=value))

    def record_before_finish(self, key: str, state: str, value: dict) -> None:
        """`record` for the job's last record, the success of its last step. When the runtime's
        finish carries it (`finish_carries`: the embedded worker's finish_and_claim writes it under
        the finish's fence, in the finish's transaction: services/chaining.py), it is only kept here
        (`before_finish`) for the finish to take, and every try of the finish takes it (but one sent
        again after a bug broke the call, which goes without it): one read of the attempt and one
        call fewer a job, and no wait of its own. Nothing acts on its answer: a stale attempt's
        record is refused, and so is its finish. Until that commit (or when the finish is refused
        for good) the record is lost, and the next attempt runs the step again, as after a kill
        just before a plain record. A refusal of the record itself (a full journal) is logged and
        does not fail the job, which succeeded: only a later re-run of the job misses the record
        and runs the step again. Otherwise (a direct call of the executor, a remote worker) a
        plain `record`."""
        if not self.finish_carries:
            self.record(key, state, value)
            return
        self.before_finish = {"key": key, "state": state, "value": value}

    def records(self) -> dict[str, Record]:
        """The job's journal by key."""
        fence = {"attempt_id": self.claim.attempt_id, "token": self.claim.token}
        return {record.key: record for record in self._call("read the journal", lambda: self.transport.records(**fence))}

    def pending_checkpoint(self) -> tuple[str, str] | None:
        """(step, content) of the running step's checkpoint file when it changed since
        the control plane last kept it; None otherwise. The runtime's heartbeat sends it."""
        checkpoint = self.checkpoint
        if checkpoint is None:
            return None
        content = checkpoint_content(checkpoint.path)
        if content is None or (checkpoint.step, content) == self.sent:
            return None
        return checkpoint.step, content

    def checkpoint_sent(self, checkpoint: tuple[str, str]) -> None:
        self.sent = checkpoint

    def checkpoint_flush(self) -> None:
        """Send the running step's checkpoint now, if it changed (a step that failed: its next
        attempt starts from it), with a heartbeat of its own; tried once, as heartbeats are."""
        if self.cancel.is_set():
            # Stopped (self-fenced, cancelled, the worker stopping): a heartbeat now would
            # extend a lease this worker has given up, and keep the job from its next attempt.
            return
        checkpoint = self.pending_checkpoint()
        if checkpoint is None:
            return
        try:
            self.transport.heartbeat(attempt_id=self.claim.attempt_id, token=self.claim.token, checkpoint=checkpoint)
        except QueueError as exc:
            verdict = classify(exc)
            if verdict in (Verdict.STALE, Verdict.SUPERSEDED, Verdict.UNAUTHORIZED):
                self.on_refused(verdict, exc)
            log.warning("job %s: checkpoint of step %s not sent (%s)", self.claim.job_id, checkpoint[0], exc)
            return
        self.checkpoint_sent(checkpoint)

    def _call(self, what: str, fn):
        backoff = Backoff(**JOURNAL_BACKOFF, rand=self.rand)
        while True:
            try:
                return fn()
            except QueueError as exc:
                verdict = classify(exc)
                if verdict is Verdict.RETRY:
                    if self.cancel.is_set():
                        raise JournalError(f"job {self.claim.job_id}: {what}: {exc}; the job was stopped", current=True) from exc
                    delay = backoff.failed(getattr(exc, "retry_after", None))
                    log.warning("job %s: %s failed (%s); sending again in %.2fs", self.claim.job_id, what, exc, delay)
                    self.sleep(delay)
                    continue
                if verdict is Verdict.REFUSED:  # malformed: sending it again cannot help
                    raise JournalError(f"job {self.claim.job_id}: {what} refused: {exc}", current=True) from exc
                self.on_refused(verdict, exc)
                raise JournalError(
                    f"job {self.claim.job_id} attempt {self.claim.attempt_id} is no longer current ({what}: {exc})",
                    current=False,
                ) from exc

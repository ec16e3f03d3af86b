"""A running job's step logs, streamed to the control plane as they are written
(`POST attempts/{id}/logs`; jobqueue/services/logs.py says how it keeps them).

The executor writes each step's output to its log file as before and only
tells the sender where a step's output begins, that it wrote some (the
runner's `on_output`), and that it ended; the sender's own thread reads the
file from there and sends what is new in chunks, so a slow or unreachable
control plane never slows the step, and the file itself is the buffer. The
thread starts at a step's first output, or when the sender is closed with
something left to send; in the embedded worker a rest that fits in one final
chunk and that no thread was started for (a quiet step's empty one, the
executor's own note on a step that could not start) is queued by the closing
thread itself, so a job whose steps print nothing costs the sender no thread
(and, where the runtime's finish carries them, `carry_final`, it is kept for
the finish, which writes it under its own fence: `carried`).
As for the buffer: the sender holds one chunk at a time however
much the step prints, and when a step has printed more than the control
plane keeps (MAX_LOG_STREAM_BYTES) it skips ahead to the tail.

Offsets count the text as sent (UTF-8 bytes), so a chunk resent after a lost
answer is recognised and stored once. In the embedded worker (`defer_final`,
a transport with `log_append_later`) a final chunk that the sender's thread
sends is queued on the group committer instead of waited for: it commits
with the next call someone waits for (at the latest the job's finish, which
the runtime sends once the sender is closed), and the runtime queues it again
ahead of a finish it retries. A transient failure is sent again after a
backoff; an answer that the attempt is stale (or this worker is superseded
or refused) stops the sender: the runtime's heartbeats deal with the attempt.
A chunk refused as malformed (a control plane's limit) drops that stream.
"""

import dataclasses
import logging
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

from jobqueue.exceptions import QueueError
from jobqueue.types import MAX_LOG_CHUNK_BYTES, MAX_LOG_STREAM_BYTES, Claim

from .backoff import Backoff
from .jobthreads import JobThreads, Run
from .transport import Transport
from .verdicts import Verdict, classify

log = logging.getLogger("apiary.worker")

READ_BYTES = MAX_LOG_CHUNK_BYTES // 4  # of the file per chunk: decoded, each byte is at most 3 (U+FFFD)
LOG_BACKOFF = {"base": 0.5, "cap": 10.0}  # seconds between resends while the control plane is unavailable
INTERVAL = 0.5  # seconds between looks at a running step's log


def complete_prefix(data: bytes) -> int:
    """The length of `data` up to its last whole UTF-8 character (an incomplete one is read next time)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
        return len(data) if need <= back else len(data) - back
    return len(data)


def text_of(data: bytes) -> str:
    """Log bytes as the protocol carries them: invalid UTF-8 and NUL become U+FFFD."""
    return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


@dataclasses.dataclass
class _Stream:
    name: str
    path: Path
    position: int  # in the file: where the next chunk is read
    end: int | None = None  # in the file, once the step ended
    offset: int = 0  # in the stream: the next chunk's offset


class LogSender:
    def __init__(
        self,
        *,
        transport: Transport,
        claim: Claim,
        interval: float = INTERVAL,
        rand: Callable[[], float] = random.random,
        threads: JobThreads | None = None,
        defer_final: bool = False,
        carry_final: bool = False,
    ):
        self.transport = transport
        # The runtime's: a finish follows the job's last chunk, so a final chunk may ride with it.
        self.later = getattr(transport, "log_append_later", None) if defer_final else None
        self.deferred: list[dict] = []  # the final chunks queued through `later`
        # The runtime's finish carries what close() itself sends (carry_final): the final chunks of
        # the streams that no thread was started for, kept here ({stream, offset, text}) for it.
        self.carry_final = carry_final and self.later is not None
        self.carried: list[dict] = []
        self.threads = threads  # the worker's job threads, to send on one of (else a thread of its own)
        self.claim = claim
        self.interval = interval
        self.rand = rand
        self.lock = threading.Lock()
        self.streams: list[_Stream] = []  # not yet sent to their end, in the order the steps began
        self.wake = threading.Event()
        self.stopped = threading.Event()  # stale, the job discarded, or closed
        self.closing = False
        self.thread: threading.Thread | Run | None = None

    # ------------------------------------------------------------------ the executor's side

    def step_started(self, stream: str, path: Path) -> None:
        """A step's output begins at the current end of `path` (a log file that earlier attempts appended to)."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.streams.append(_Stream(stream, Path(path), _size(path)))
            if self.thread is None:
                return  # nothing to send yet: the thread starts at the first output
        self.wake.set()

    def output_written(self) -> None:
        """The step wrote output to its log (the runner's on_output, on the job's thread): the
        first time, the sender's thread starts; after that it looks every `interval` anyway."""
        if self.thread is None:
            with self.lock:
                if self.thread is None and not self.stopped.is_set():
                    self._start()

    def _start(self) -> threading.Thread | Run:
        """Under the lock: the sender's thread, which looks at the streams as it starts."""
        name = f"job-{self.claim.job_id}-logs"
        if self.threads is not None:
            self.thread = self.threads.start(self._loop, name)
        else:
            self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self.thread.start()
        return self.thread

    def step_ended(self, stream: str) -> None:
        """The step's output ends at the current end of its file: the sender sends it to there, then ends the stream."""
        with self.lock:
            for item in self.streams:
                if item.name == stream and item.end is None:
                    item.end = _size(item.path)
        self.wake.set()

    # ------------------------------------------------------------------ the runtime's side

    def close(self, timeout: float) -> bool:
        """Let the sender send what the steps wrote, for at most `timeout` seconds, then stop it;
        True when everything was sent. The runtime calls it before it sends the job's finish,
        after which the attempt takes no more chunks."""
        with self.lock:
            self.closing = True
            thread = self.thread
            here = thread is None and self._queues_the_rest()
            if thread is None and not here and self.streams and not self.stopped.is_set():
                thread = self._start()
        if here:  # no thread ever started, and nothing to wait for: the rest goes in final chunks,
            # queued (or, with carry_final, kept for the finish to carry)
            for stream in list(self.streams):
                if self._send_available(stream):
                    self.streams.remove(stream)
        else:
            self.wake.set()
            if thread is not None:
                thread.join(timeout)
        self.stop()
        with self.lock:
            return not self.streams

    def _queues_the_rest(self) -> bool:
        """Under the lock, at close: every stream ended, and what is left of each fits in its final
        chunk, which `later` queues (or `carried` keeps for the finish) without waiting."""
        return self.later is not None and not self.stopped.is_set() and all(
            s.end is not None and s.end - s.position <= READ_BYTES for s in self.streams
        )

    def stop(self) -> None:
        """Send nothing more (the job's result is discarded, or the worker stops). Under the lock:
        once it returns, no final chunk is queued any more (close() returns, then the finish is sent)."""
        with self.lock:
            self.stopped.set()
        self.wake.set()

    def resend_deferred(self) -> None:
        """Queue the deferred final chunks again ahead of a retried finish: the commit that failed
        the finish may have held them (a chunk resent is recognised by its offset and kept once).
        The group committer puts a failed commit's deferred calls back in line by itself, for a few
        commits: this covers a finish that keeps failing longer."""
        with self.lock:
            chunks = list(self.deferred)
        for chunk in chunks:
            self.later(**chunk)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        try:
            while not self.stopped.is_set():
                with self.lock:
                    current = self.streams[0] if self.streams else None
                    closing = self.closing
                if current is None:
                    if closing:
                        return
                    self._pause(None)  # no step runs: nothing to look at until one starts, or close or stop
                    continue
                if self._send_available(current):  # sent to its end
                    with self.lock:
                        self.streams.remove(current)
                    continue
                if not self.stopped.is_set():
                    self._pause(self.interval)  # the step runs: look at its file again then
        except Exception:  # a bug here must cost the logs only, never the job
            log.exception("job %s: the log sender failed; this job's logs stay on the worker", self.claim.job_id)
        finally:
            self.stopped.set()
            self.transport.close()  # this thread's database connection (in-process transport)

    def _pause(self, timeout: float | None) -> None:
        self.wake.wait(timeout)
        self.wake.clear()

    def _send_available(self, stream: _Stream) -> bool:
        """Send what the step's file holds now; True once the stream was sent to its end (or given up)."""
        while not self.stopped.is_set():
            end = stream.end
            size = _size(stream.path) if end is None else end
            if size - stream.position > MAX_LOG_STREAM_BYTES:  # more than is kept: skip to the tail
                skip = size - stream.position - MAX_LOG_STREAM_BYTES + READ_BYTES
                stream.position += skip
                stream.offset += skip  # counted as bytes of text: the control plane drops what came before
            data = _read(stream.path, stream.position, min(READ_BYTES, max(0, size - stream.position)))
            last = end is not None and stream.position + len(data) >= end
            cut = len(data) if last else complete_prefix(data)
            if cut == 0 and not last:
                return False  # nothing new yet
            text = text_of(data[:cut])
            if not self._send(stream, text, final=last):
                return True  # refused: this stream is given up
            stream.position += cut
            stream.offset += len(text.encode("utf-8"))
            if last:
                return True
        return False

    def _send(self, stream: _Stream, text: str, *, final: bool) -> bool:
        """One chunk, sent again while the control plane is unavailable; False when refused for good."""
        if final and self.later is not None:  # no answer to wait for: nothing follows it but the finish
            with self.lock:  # never queued after stop(): the finish may be queued right after it
                if self.stopped.is_set():
                    return False
                if self.carry_final and self.thread is None:  # close() sends it, and the finish follows
                    self.carried.append({"stream": stream.name, "offset": stream.offset, "text": text})
                    return True
                chunk = {"attempt_id": self.claim.attempt_id, "token": self.claim.token, "stream": stream.name,
                         "offset": stream.offset, "text": text, "final": True}  # fmt: skip
                self.deferred.append(chunk)
                self.later(**chunk)
            return True
        backoff = Backoff(**LOG_BACKOFF, rand=self.rand)
        while not self.stopped.is_set():
            try:
                self.transport.log_append(
                    attempt_id=self.claim.attempt_id, token=self.claim.token, stream=stream.name,
                    offset=stream.offset, text=text, final=final,
                )  # fmt: skip
                return True
            except QueueError as exc:
                verdict = classify(exc)
                if verdict is Verdict.RETRY:
                    delay = backoff.failed(getattr(exc, "retry_after", None))
                    log.debug("job %s: log chunk of %s not sent (%s); again in %.2fs", self.claim.job_id, stream.name, exc, delay)
                    self.stopped.wait(delay)
                    continue
                if verdict is Verdict.REFUSED:
                    log.warning("job %s: the control plane refused the log of step %s (%s); it stays on the worker",
                                self.claim.job_id, stream.name, exc)  # fmt: skip
                    return False
                log.info("job %s attempt %s: log stream stopped (%s)", self.claim.job_id, self.claim.attempt_id, exc.code)
                self.stop()
                return False
        return False


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: Path, position: int, count: int) -> bytes:
    if count <= 0:
        return b""
    try:
        with open(path, "rb") as file:
            file.seek(position)
            return file.read(count)
    except OSError:
        return b""

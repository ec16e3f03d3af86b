"""Threads for a worker's jobs, kept for the next job instead of ended.

Starting a thread costs about 0.1 ms of CPU (the OS thread and threading's
own bookkeeping), more than a short job's whole Python path elsewhere, and a
worker starts one per job. A thread that finished its job waits IDLE_SECONDS
for the next one, then ends; a worker that runs nothing holds no thread.

`start(fn, name)` runs `fn()` on an idle thread (or a new one) renamed `name`
and answers a handle with `is_alive()` and `join()`, as a Thread's, for the
one run.
"""

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("apiary.worker")

IDLE_SECONDS = 5.0


class Run:
    """One job's run on a pool thread: alive from start until `fn` returned or raised."""

    __slots__ = ("fn", "name", "_done")

    def __init__(self, fn: Callable[[], None], name: str):
        self.fn, self.name = fn, name
        self._done = threading.Event()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


class JobThreads:
    def __init__(self, *, idle_seconds: float = IDLE_SECONDS):
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inbox of each thread waiting for a run

    def start(self, fn: Callable[[], None], name: str) -> Run:
        run = Run(fn, name)
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put(run)
            return run
        inbox = queue.SimpleQueue()
        inbox.put(run)
        threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        return run

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                run = inbox.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody handed it a run meanwhile: end
                        self._idle.remove(inbox)
                        return
                run = inbox.get()  # a run was handed over just as the wait ended
            threading.current_thread().name = run.name
            try:
                run.fn()
            except Exception:  # noqa: BLE001 - as an uncaught error would end a plain thread: logged
                log.exception("%s failed", run.name)
            finally:
                run._done.set()
            with self._lock:  # not reached after a BaseException: the thread ends with it
                self._idle.append(inbox)

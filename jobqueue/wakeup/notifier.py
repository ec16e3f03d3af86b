"""Waiting claims and the wake-ups that end their wait, inside one process.

A long-poll that found nothing registers a `Waiter` (its worker's pool,
labels and capabilities) and waits on it, holding no thread, connection or
transaction. A `Wake` says that jobs may have become claimable: of one job
class (requirement set), or of any class (a limit slot or a pin was freed),
perhaps only for one worker (a pinned job, an undrain), perhaps only from a
given time on (a retry's backoff). The notifier hands each wake to at most
`count` waiters that could use it, in arrival order, so one enqueue wakes
one worker, not the fleet.

Wakes can be missed (a notification lost while reconnecting, a pin freed by
time): a slow fallback tick wakes the oldest waiter of one worker shape
(pool, labels, capabilities) per `fallback` seconds, round-robin over the
shapes, and a waiter that the fallback woke and that then claimed passes the
turn to the next one. A missed wake costs latency, never a job.

`quiet()` lets a worker that just came back empty skip the claim transaction
at the start of its next long-poll: it is true while no wake that the worker
could use has arrived since. The watcher thread (watch.py) feeds wakes from
other processes and calls `tick()`; services feed this process's own wakes
after their commit.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

Shape = tuple[str | None, frozenset, frozenset]  # a worker's pool, labels, capabilities
Resolve = Callable[[int], "Shape | None"]  # requirement set id → what it needs, None when unknown


@dataclasses.dataclass(frozen=True)
class Wake:
    requirements: int | None  # the job class that became claimable; None: any class
    worker_id: str | None = None  # only this worker can use it
    count: int = 1  # how many waiters it can serve
    delay: float = 0.0  # seconds from now until it can be used
    needs: Shape | None = None  # what the class requires, when the sender knew it


class Waiter:
    """One waiting claim. `fire()` may be called from any thread.

    A `blocked` waiter's worker could not claim for other reasons than a
    lack of jobs (draining, not ready, at capacity): only wakes addressed to
    it by name can change that, and the fallback passes it by."""

    def __init__(self, worker_id: str, shape: Shape):
        self.worker_id = worker_id
        self.shape = shape
        self.seq = 0  # arrival order, kept across re-waits of one long-poll
        self.blocked = False
        self.checked_at = 0.0  # when the fallback last woke it (monotonic)
        self.wake: Wake | None = None  # what fired it, until taken
        self.by_fallback = False
        self._event = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_event: asyncio.Event | None = None

    def fire(self, wake: Wake, *, by_fallback: bool = False) -> None:
        self.wake, self.by_fallback = wake, by_fallback
        self._event.set()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody awaits it any more
                self._loop.call_soon_threadsafe(self._async_event.set)

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    async def wait_async(self, timeout: float) -> bool:
        if self._async_event is None:
            self._async_event = asyncio.Event()
            self._loop = asyncio.get_running_loop()  # from now on fire() also sets the asyncio event
        if self._event.is_set():
            self._async_event.set()
        try:
            await asyncio.wait_for(self._async_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def fired(self) -> bool:
        """Fired and not yet taken (a wake it must give back if it leaves)."""
        return self._event.is_set()

    def take(self) -> None:
        """It acts on the wake that fired it (a claim round follows)."""
        self._event.clear()
        if self._async_event is not None:
            self._async_event.clear()
        self.wake = None


def _usable(wake: Wake, waiter: Waiter, resolve: Resolve) -> bool:
    if wake.worker_id is not None:
        return wake.worker_id == waiter.worker_id
    if waiter.blocked:
        return False
    return _fits(wake, waiter.shape, resolve)


def _fits(wake: Wake, shape: Shape, resolve: Resolve) -> bool:
    if wake.requirements is None and wake.needs is None:
        return True
    needs = wake.needs or resolve(wake.requirements)
    if needs is None:  # a class this process has not seen yet: let a claim find out
        return True
    need_pool, need_labels, need_caps = needs
    pool, labels, caps = shape
    return (need_pool is None or need_pool == pool) and labels >= need_labels and caps >= need_caps


class Notifier:
    RECENT = 512  # wakes remembered for quiet(); older memos are not trusted
    QUIET_FOR = 30.0  # seconds a memo stays trusted at most

    def __init__(self, *, resolve: Resolve = lambda pk: None, fallback: float = 1.0, monotonic=time.monotonic):
        self.resolve = resolve
        self.fallback = fallback
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self.arrived = threading.Event()  # set by add(): the watcher polls fast again
        self.reset()

    def reset(self) -> None:
        """Forget every waiter, timer and memo (tests start each from nothing)."""
        with self._lock:
            self._init_state()

    def _init_state(self) -> None:
        self._waiters: list[tuple[int, Waiter]] = []  # (seq, waiter), arrival order
        self._arrivals = itertools.count(1)
        self._timers: list[tuple[float, int, Wake]] = []
        self._timer_ids = itertools.count()
        self._recent: deque[tuple[int, Wake]] = deque(maxlen=self.RECENT)
        self._wakes = 0  # wakes delivered so far (their sequence numbers)
        self._quiet: dict[str, tuple[str, Shape, int, float]] = {}
        self._next_fallback = self.monotonic() + self.fallback
        self._turn = 0  # round-robin position over waiter shapes

    # ---------------------------------------------------------------- waiters
    def mark(self) -> int:
        """The number of the last wake delivered, for add(since=…)."""
        with self._lock:
            return self._wakes

    def add(self, waiter: Waiter, *, since: int | None = None) -> None:
        """Wait in arrival order. With `since` (a mark() taken before the claim
        that came back empty), a wake it could use that arrived after the mark
        fires it at once: nothing falls between that claim and this wait."""
        with self._lock:
            if not waiter.seq:
                waiter.seq = next(self._arrivals)
            if since is not None and since < self._wakes:
                oldest = self._recent[0][0] if self._recent else self._wakes + 1
                missed = next(
                    (wake for number, wake in self._recent if number > since and _usable(wake, waiter, self.resolve)),
                    None,
                )
                if missed is None and since + 1 < oldest:  # too many wakes since to tell: assume one was for it
                    missed = Wake(requirements=None, worker_id=waiter.worker_id)
                if missed is not None:
                    waiter.fire(missed)
                    return
            bisect.insort(self._waiters, (waiter.seq, waiter), key=lambda item: item[0])
        self.arrived.set()

    def remove(self, waiter: Waiter) -> None:
        with self._lock:
            self._drop(waiter)

    def _drop(self, waiter: Waiter) -> None:
        i = bisect.bisect_left(self._waiters, waiter.seq, key=lambda item: item[0])
        if i < len(self._waiters) and self._waiters[i][1] is waiter:
            del self._waiters[i]

    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    # ------------------------------------------------------------------ wakes
    def publish(self, wake: Wake) -> None:
        """A wake from this process's commits or from the watcher."""
        if wake.delay > 0:
            with self._lock:
                heapq.heappush(self._timers, (self.monotonic() + wake.delay, next(self._timer_ids), wake))
            return
        self._deliver(wake)

    def _deliver(self, wake: Wake, *, by_fallback: bool = False) -> None:
        chosen = []
        with self._lock:
            self._wakes += 1
            self._recent.append((self._wakes, wake))
            for _seq, waiter in self._waiters:
                if len(chosen) == wake.count:
                    break
                if _usable(wake, waiter, self.resolve):
                    chosen.append(waiter)
            for waiter in chosen:
                self._drop(waiter)
        for waiter in chosen:
            waiter.fire(wake, by_fallback=by_fallback)

    def tick(self) -> None:
        """Fire due timers; every `fallback` seconds wake one waiter for a re-check."""
        now = self.monotonic()
        due = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
        for wake in due:
            self._deliver(dataclasses.replace(wake, delay=0.0))
        if now < self._next_fallback:
            return
        self._next_fallback = now + self.fallback
        with self._lock:
            for worker_id, memo in list(self._quiet.items()):
                if now - memo[3] > self.QUIET_FOR:
                    del self._quiet[worker_id]
            # Per shape, the waiter checked longest ago (arrival order breaks ties);
            # then one shape per tick, in turn.
            pick: dict[Shape, Waiter] = {}
            for _seq, waiter in self._waiters:
                if waiter.blocked:
                    continue
                best = pick.get(waiter.shape)
                if best is None or waiter.checked_at < best.checked_at:
                    pick[waiter.shape] = waiter
            if not pick:
                return
            shapes = list(pick.values())
            waiter = shapes[self._turn % len(shapes)]
            self._turn += 1
            waiter.checked_at = now
            self._drop(waiter)
        waiter.fire(Wake(requirements=None, worker_id=waiter.worker_id), by_fallback=True)

    def next_tick(self) -> float:
        """Seconds until `tick()` has something to do (the earliest timer, the next fallback); 0 when due."""
        with self._lock:
            due = min(self._timers[0][0], self._next_fallback) if self._timers else self._next_fallback
        return max(0.0, due - self.monotonic())

    def pass_turn(self) -> None:
        """A waiter the fallback woke claimed something: more may be left that
        no wake announced, so the next waiter checks too."""
        self._deliver(Wake(requirements=None), by_fallback=True)

    def give_back(self, waiter: Waiter) -> None:
        """A waiter leaves (its wait ran out, its client hung up) with a wake it
        did not act on: the wake goes to the next waiter instead of being lost."""
        wake = waiter.wake
        if waiter.fired() and wake is not None:
            waiter.take()
            if wake.worker_id != waiter.worker_id:  # one addressed to it alone has nobody else to go to
                self._deliver(wake, by_fallback=waiter.by_fallback)

    # ------------------------------------------------------------------ quiet
    def came_back_empty(self, worker_id: str, session: str, shape: Shape) -> None:
        with self._lock:
            self._quiet[worker_id] = (session, shape, self._wakes, self.monotonic())

    def quiet(self, worker_id: str, session: str) -> Shape | None:
        """The worker's shape when nothing it could claim can have appeared
        since its last empty claim in this process; None when it must claim."""
        with self._lock:
            memo = self._quiet.get(worker_id)
            if memo is None:
                return None
            memo_session, shape, seen, at = memo
            oldest_known = self._recent[0][0] if self._recent else self._wakes + 1
            if (
                memo_session != session
                or self.monotonic() - at > self.QUIET_FOR
                or (seen + 1 < oldest_known and seen < self._wakes)  # wakes since then were forgotten
            ):
                del self._quiet[worker_id]
                return None
            for number, wake in self._recent:
                usable = wake.worker_id == worker_id if wake.worker_id is not None else _fits(wake, shape, self.resolve)
                if number > seen and usable:
                    del self._quiet[worker_id]
                    return None
            return shape

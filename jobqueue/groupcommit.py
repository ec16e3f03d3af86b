"""Group commit: the durable calls of many threads of one process in one transaction.

Each queue service is one durable transaction, and on SQLite with
`synchronous=FULL` (or PostgreSQL with `synchronous_commit=on`) most of a
short call's time is its commit. A process whose threads make many such
calls at once — the embedded worker's job threads finishing, recording,
streaming logs — can share commits: a call waits in line while a commit is
under way, and the next commit carries every call that queued meanwhile.
The batch runs without savepoints; if a call in it fails, the batch is
rolled back and run again with a savepoint per call, so only the failing
call is refused. (A service's body for many calls at once, its `many`,
answers a refusal itself, for a call that wrote nothing, without a
rollback.) Nothing is answered before the COMMIT that holds it returns: a
caller gets its result (or its error) only then, and a commit
that fails, or a transaction that a call left broken, answers every call
in it `Unavailable`, with none of them written. No call that someone
waits for waits for company: with nobody committing it commits at once, alone.

Who commits: a thread of the committer's own, on its one connection; the
callers only wait (the embedded worker's job and log-sender threads come and
go, and each would otherwise open a connection of its own). The thread ends
after IDLE_SECONDS without a call and starts again with the next, so a
committer nobody uses holds no connection. A call made inside a transaction
of the caller's own (a test's) runs there, as the plain service would.

`call(service, **kwargs)` takes a function made with `services.common.service`
(its body runs here: `service.body`); `defer(...)` queues one that nobody
waits for (step history). A deferred call does not wake the committer (it
only starts its thread when none runs): it rides with the next call that
someone waits for, or, when none comes within DEFER_SECONDS, commits then —
so a job's step history costs no commit of its own, and is committed about
DEFER_SECONDS after it was queued at the latest (plus the time the commits
ahead of it take). A commit that fails as a whole puts its deferred calls back
at the head of the line, up to DEFERRED_TRIES commits (a call refused by
itself is not tried again: its error is logged). The embedded worker's last call as it stops, its
`ready: false` heartbeat, commits what is still deferred.
"""

import logging
import threading
import time
from collections.abc import Callable

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    close_old_connections,
    connection,
    connections,
    transaction,
)

from .exceptions import QueueError, Unavailable

log = logging.getLogger("apiary.queue")

MAX_BATCH = 256  # calls per commit: bounds how long one commit holds SQLite's write lock
DEFER_SECONDS = 0.5  # how long a deferred call waits at most for a call to share a commit with
DEFERRED_TRIES = 3  # commits a deferred call is put in before a failure of the whole commit drops it


class _Call:
    """One call in line. `done` is held from the start and released once the commit holding the
    call is over: a plain lock is the cheapest one-shot signal between two threads."""

    __slots__ = ("body", "kwargs", "waiting", "done", "result", "error", "tries")

    def __init__(self, body: Callable, kwargs: dict, *, waiting: bool):
        self.body, self.kwargs, self.waiting = body, kwargs, waiting  # waiting: a caller waits (not deferred)
        self.tries = 0  # commits that failed with the call in them (a deferred call is queued again)
        self.done = threading.Lock()
        self.done.acquire()
        self.result: object = None
        self.error: BaseException | None = None


_local = threading.local()


def _in_transaction() -> bool:
    """Whether the calling thread is inside a transaction of its own. Each thread's connection
    wrapper is kept for the thread's life, so it is looked up once per thread: Django's
    per-thread lookup costs more than a small call's own work here."""
    try:
        wrapper = _local.connection
    except AttributeError:
        wrapper = _local.connection = connections[DEFAULT_DB_ALIAS]
    return wrapper.in_atomic_block


class GroupCommitter:
    IDLE_SECONDS = 5.0

    def __init__(self, *, max_batch: int = MAX_BATCH, defer_seconds: float = DEFER_SECONDS):
        if not defer_seconds > 0:
            raise ValueError(f"defer_seconds must be more than 0, got {defer_seconds!r}")
        self.max_batch = max_batch
        self.defer_seconds = defer_seconds
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # a call that someone waits for is queued
        self._pending: list[_Call] = []
        self._waited = 0  # calls in _pending that someone waits for
        self._deferred_at: float | None = None  # monotonic time the oldest deferred call in _pending was queued
        self._running = False  # the committing thread runs
        self.before_commit: Callable[[int], None] = lambda size: None  # tests: the point to kill a process at

    def call(self, service: Callable, /, **kwargs):
        """`service(**kwargs)`, committed with whatever other calls are queued; its result or error."""
        item = _Call(_body(service), kwargs, waiting=True)
        if _in_transaction():  # the caller's own transaction: no one else's calls belong in it
            return _run_one(item.body, kwargs)
        self._enqueue(item)
        item.done.acquire()
        if item.error is not None:
            raise item.error
        return item.result

    def defer(self, service: Callable, /, **kwargs) -> None:
        """`service(**kwargs)` with the next commit; nobody waits for it. Its errors are logged, not raised."""
        item = _Call(_body(service), kwargs, waiting=False)
        if _in_transaction():
            try:
                _run_one(item.body, kwargs)
            except (QueueError, DatabaseError) as exc:
                log.warning("deferred %s failed: %s", item.body.__name__, exc)
            return
        self._enqueue(item)

    def flush(self) -> None:
        """Wait until everything queued before this call is committed (at shutdown)."""
        self.call(_nothing)

    def _enqueue(self, item: _Call) -> None:
        with self._lock:
            self._pending.append(item)
            if item.waiting:
                self._waited += 1
            elif self._deferred_at is None:
                self._deferred_at = time.monotonic()
            if not self._running:
                self._start_thread()
            if item.waiting:  # a deferred call waits for company: a running committer is not woken for it
                self._ready.notify()

    def _take(self) -> list[_Call] | None:
        """Under the lock, on the committing thread: the next batch, once a call that someone waits
        for is queued or the oldest deferred one has waited defer_seconds; None after IDLE_SECONDS
        with nothing queued. A deferred call wakes nobody, so the idle wait is cut into slices of
        defer_seconds: a timer's wake-up, not one per call."""
        idle_since = time.monotonic()
        while not self._waited:
            now = time.monotonic()
            if self._deferred_at is None:
                if now - idle_since >= self.IDLE_SECONDS:
                    return None
                self._ready.wait(min(self.defer_seconds, self.IDLE_SECONDS))
                continue
            left = self._deferred_at + self.defer_seconds - now
            if left <= 0:
                break
            self._ready.wait(left)
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        self._waited = sum(item.waiting for item in self._pending)
        if self._waited == len(self._pending):  # no deferred call left over from a batch cut at max_batch
            self._deferred_at = None  # (left over, they keep the oldest's time: they have waited that long)
        return batch

    def _start_thread(self) -> None:
        """Under the lock: the committing thread, started (a failure to start leaves no one
        marked as committing, and the caller sees the error)."""
        self._running = True
        try:
            threading.Thread(target=self._serve, name="apiary-commit", daemon=True).start()
        except BaseException:
            self._running = False
            self._pending.clear()
            self._waited, self._deferred_at = 0, None
            raise

    def _serve(self) -> None:
        """The committing thread: commit what is queued, until idle for IDLE_SECONDS."""
        idle = False
        try:
            while True:
                with self._lock:
                    batch = self._take()
                    if batch is None:
                        self._running, idle = False, True  # the next call starts a thread again
                        return
                try:
                    if not self._commit(batch):  # answers every call in it, whatever happens
                        close_old_connections()  # a broken connection is replaced before the next batch
                except Exception:  # noqa: BLE001 - a bug must not end the thread its callers wait on
                    log.exception("group commit of %d call(s) failed", len(batch))
                    close_old_connections()
        finally:
            connection.close()
            if not idle:  # torn out of the loop: a thread must still answer what is queued
                with self._lock:
                    self._running = False
                    if self._pending:
                        self._start_thread()

    def _commit(self, batch: list[_Call]) -> bool:
        """Commit the batch and answer every call in it; False when the commit itself failed."""
        failed = None
        try:
            if len(batch) == 1:
                # Alone in its commit: its failure rolls back only its own writes, so it needs no savepoint.
                self._commit_alone(batch[0])
            elif not self._commit_together(batch):
                self._commit_apart(batch)
        except DatabaseError as exc:  # BEGIN or COMMIT failed, or a call broke the transaction: nothing was written
            failed = Unavailable.of(exc)
            _forget_uncommitted()
        except BaseException as exc:
            failed = Unavailable(f"group commit failed: {exc!r}")  # its callers must not wait for ever
            raise
        finally:
            again = []
            for item in batch:
                if failed is not None:
                    item.result, item.error = None, failed
                    item.tries += 1
                    if not item.waiting and item.tries < DEFERRED_TRIES:
                        again.append(item)  # no caller will send it again: it goes in the next commit
                        continue
                if item.error is not None and not item.waiting:
                    log.warning("deferred %s failed: %s", item.body.__name__, item.error)
                item.done.release()
            if again:
                self._requeue(again)
        return failed is None

    def _requeue(self, items: list[_Call]) -> None:
        """Deferred calls of a commit that failed as a whole (not by an error of their own), put
        back ahead of everything queued since, in their order: their threads went on, so nobody
        sends them again, and a retried finish that follows them must still come after them."""
        log.info("group commit failed; %d deferred call(s) go in the next one", len(items))
        for item in items:
            item.result = item.error = None  # this try's answer is not theirs: the next commit's is
        with self._lock:
            self._pending[:0] = items
            if self._deferred_at is None:
                self._deferred_at = time.monotonic()

    def _commit_together(self, batch: list[_Call]) -> bool:
        """The batch in one transaction without savepoints (two statements fewer per call);
        False, with nothing written, when a call failed: the batch is then run again apart."""
        try:
            with transaction.atomic(durable=True):
                for body, items in _by_body(batch):
                    try:
                        many = getattr(body, "many", None)  # the service's body for many calls at once
                        if len(items) > 1 and many is not None:
                            for item, (result, error) in zip(items, many([i.kwargs for i in items]), strict=True):
                                item.result, item.error = result, error
                        else:
                            for item in items:
                                item.result = item.body(**item.kwargs)
                    except Exception as exc:  # noqa: BLE001 - rolls the batch back; _commit_apart answers it
                        raise _Refused from exc
                _require_intact()
                self.before_commit(len(batch))
        except _Refused:
            for item in batch:
                item.result = item.error = None
            _forget_uncommitted()
            return False
        return True

    def _commit_apart(self, batch: list[_Call]) -> None:
        """The batch with a savepoint per call: a call that fails leaves no write, the others commit."""
        with transaction.atomic(durable=True):
            for item in batch:
                try:
                    with transaction.atomic():
                        item.result = item.body(**item.kwargs)
                except Exception as exc:  # noqa: BLE001 - the caller's, as the plain call's would be
                    item.error = _answer_of(exc)
                _require_intact()  # a savepoint that could not be rolled back took the transaction with it
            self.before_commit(len(batch))

    def _commit_alone(self, item: _Call) -> None:
        try:
            with transaction.atomic(durable=True):
                try:
                    item.result = item.body(**item.kwargs)
                except Exception as exc:  # noqa: BLE001 - the caller's, as the plain call's would be
                    item.error = _answer_of(exc)
                    raise _Refused from exc
                _require_intact()
                self.before_commit(1)
        except _Refused:  # alone, it rolled back only its own writes (a call that cached a class of its own
            pass  # forgets it itself: services/chaining.py)


def _by_body(batch: list[_Call]) -> list[tuple[Callable, list[_Call]]]:
    """The batch's calls grouped by service, so that a service's calls may run together
    (its `many`), in an order they could have run in.

    Deferred calls go first, in their order, a run of one service's calls together. A
    deferred call's thread went on, so what that thread sent next was queued after it and
    still runs after it; and it depends on no call that someone still waits for, since its
    thread saw none of them answered. (In the embedded worker a batch's finishes would
    otherwise be cut apart by the step history deferred between them, and each would read
    its attempt and claim the next job alone.) A deferred call on an attempt that a waited
    call queued before it is about is not moved: it and every call after it stay in place.

    Calls that callers wait for were made by threads blocked on them, so their order is
    free, with two exceptions kept in place: a deferred call left where it was, and a call
    on an attempt that an earlier call of the batch is about (a job's finish sent while its
    log sender's last chunk still waits in line). Neither is ever moved, nor a call moved
    across one."""
    ahead: list[_Call] = []  # the deferred calls that go first
    waited: list[_Call] = []  # the waited calls queued before the first deferred call that stays
    attempts: set = set()
    rest: list[_Call] = []
    for n, item in enumerate(batch):
        attempt = item.kwargs.get("attempt_id")
        if item.waiting:
            waited.append(item)
            if attempt is not None:
                attempts.add(attempt)
        elif attempt is not None and attempt in attempts:
            rest = batch[n:]
            break
        else:
            ahead.append(item)
    groups: list[tuple[Callable, list[_Call]]] = []
    for item in ahead:
        if groups and groups[-1][0] is item.body:
            groups[-1][1].append(item)
        else:
            groups.append((item.body, [item]))
    return groups + _in_place_by_body(waited + rest)


def _in_place_by_body(calls: list[_Call]) -> list[tuple[Callable, list[_Call]]]:
    """_by_body's grouping of what follows the deferred calls it moved ahead: waited calls, and
    any deferred call left in place (which nothing is moved across)."""
    groups: list[tuple[Callable, list[_Call]]] = []
    open_groups: dict[Callable, list[_Call]] = {}  # the groups since the last call kept in place
    attempts: set = set()  # the attempts the calls since then are about
    for item in calls:
        attempt = item.kwargs.get("attempt_id")
        if not item.waiting or (attempt is not None and attempt in attempts):
            open_groups, attempts = {}, set()
        if attempt is not None:
            attempts.add(attempt)
        if item.body in open_groups:
            open_groups[item.body].append(item)
        else:
            open_groups[item.body] = [item]
            groups.append((item.body, open_groups[item.body]))
        if not item.waiting:
            open_groups, attempts = {}, set()
    return groups


def _require_intact() -> None:
    """Inside the batch's transaction: a DatabaseError (so every call is answered Unavailable)
    when Django would roll it back at the end without a word (a savepoint rollback that
    failed, a connection lost mid-batch), instead of letting its calls be answered as done."""
    if connection.needs_rollback or connection.closed_in_transaction:
        raise DatabaseError("the batch's transaction was broken by one of its calls; nothing of it was written")


def _forget_uncommitted() -> None:
    """A batch was rolled back: job classes that a claim in it read (and the process cached)
    may have been created by another call in it, and exist no more."""
    from .services.claiming import requirement_cache  # the services import this module's users

    requirement_cache.reset()


class _Refused(Exception):
    """A call's error, carried out of the transaction it rolls back."""


def _answer_of(exc: Exception) -> Exception:
    """What a caller gets for its call's error: a database error as the service's own wrapper maps it."""
    return Unavailable.of(exc) if isinstance(exc, OperationalError) else exc


def _nothing() -> None:
    """flush()'s marker call: answered once everything queued before it is committed."""


_nothing.body = _nothing


def _body(service: Callable) -> Callable:
    body = getattr(service, "body", None)
    if body is None:
        raise TypeError(f"{service!r} is not a queue service (services.common.service)")
    return body


def _run_one(body: Callable, kwargs: dict):
    """One call in the caller's open transaction, in a savepoint as the batch's are."""
    try:
        with transaction.atomic():
            return body(**kwargs)
    except OperationalError as exc:
        raise Unavailable.of(exc) from exc

"""Long-poll claims: claim, and with `wait` > 0 and nothing claimable, wait
for a wake-up (jobqueue.wakeup) and claim again, until something is claimed
or `wait` seconds pass.

While it waits a long-poll holds no transaction, no database connection and
runs no query: it is a `Waiter` in this process's notifier. One claim
transaction runs per wake it receives. A worker whose previous long-poll in
this process came back empty, with no wake since that it could use, does not
even run the first one.

The steps are written once (`_steps`, a generator that asks for claim rounds
and waits) and driven twice: `claim_with_wait` blocks its thread (the
embedded worker, the WSGI view), `claim_with_wait_async` awaits (the ASGI
claim endpoint) and runs each claim round in a small thread pool.
"""

import asyncio
import logging
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections

from jobqueue import services
from jobqueue.types import Claim
from jobqueue.wakeup import Waiter, Wake, notifier, watch

log = logging.getLogger("apiary.queue.claims")

CLAIM_THREADS = 4
CONTENDED_RETRY = 0.05  # seconds before claiming again jobs that were locked by another claimer  # claim transactions of waiting long-polls in flight at once, per process

_monotonic = time.monotonic  # the long-poll tests replace it
_claim_pool = ThreadPoolExecutor(max_workers=CLAIM_THREADS, thread_name_prefix="apiary-claim")
_release = close_old_connections  # after each claim round (tests keep their one connection open instead)

Step = tuple[str, object]


def _steps(*, worker_id: str, session: str, max_jobs: int, wait: float) -> Generator[Step, object, list[Claim]]:
    """Yields ("claim", kwargs) to get a claim Round, ("wait", (waiter, seconds))
    to get whether the waiter was woken; returns the claims."""
    deadline = _monotonic() + wait
    arguments = {"worker_id": worker_id, "session": session, "max_jobs": max_jobs}
    if wait > 0:
        watch.ensure_running()
    mark = notifier.mark()
    shape = notifier.quiet(worker_id, session) if wait > 0 else None
    blocked = False
    waiter = None
    try:
        while True:
            if shape is None or waiter is not None:
                mark = notifier.mark()
                result = yield "claim", arguments
                log.debug("claim round: worker %s, %d job(s)", worker_id, len(result.claims))
                if result.claims:
                    if waiter is not None and waiter.by_fallback:
                        notifier.pass_turn()  # more may be left that no wake announced
                    return result.claims
                if result.contended:  # jobs another claimer held locked: look again in a moment
                    notifier.publish(Wake(requirements=None, worker_id=worker_id, delay=CONTENDED_RETRY))
                elif result.starved:
                    notifier.came_back_empty(worker_id, session, result.shape)
                shape, blocked = result.shape, not (result.starved or result.contended)
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return []
            if waiter is None:
                waiter = Waiter(worker_id, shape)
            waiter.blocked = blocked
            notifier.add(waiter, since=mark)
            if not (yield "wait", (waiter, remaining)):
                if not blocked:  # it waited in line for every wake it could use: quiet until the next one
                    notifier.came_back_empty(worker_id, session, shape)
                return []
            waiter.take()
    finally:
        if waiter is not None:
            notifier.remove(waiter)
            notifier.give_back(waiter)  # a wake that fired it as it left goes to the next waiter


def claim_with_wait(*, worker_id: str, session: str, max_jobs: int, wait: float, committer=None) -> list[Claim]:
    """The long-poll in the calling thread (which keeps its own connection). With a
    `committer` (jobqueue.groupcommit) each round shares the commit of its other calls."""
    steps = _steps(worker_id=worker_id, session=session, max_jobs=max_jobs, wait=wait)
    answer = None
    try:
        while True:
            kind, arg = steps.send(answer)
            if kind != "claim":
                answer = arg[0].wait(arg[1])
            elif committer is not None:
                answer = committer.call(services.claim_round, **arg)
            else:
                answer = services.claim_round(**arg)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


async def offload(pool: ThreadPoolExecutor, fn, *args):
    """`fn(*args)` in `pool`, awaited (the seam tests replace to keep every
    call on the test's thread and its database connection)."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _claim_round(arguments: dict):
    try:
        return services.claim_round(**arguments)
    finally:
        _release()  # drops a broken connection; on PostgreSQL under the listener, back to the pool


async def _claim_round_shielded(arguments: dict):
    """A claim round that a cancel (the client hung up) cannot cut in half:
    the round runs to its end, and what it leased is given back at once."""
    running = asyncio.ensure_future(offload(_claim_pool, _claim_round, arguments))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        result = await running
        for claim in result.claims:
            await offload(_claim_pool, _abandon, claim)
        raise


def _abandon(claim: Claim) -> None:
    try:
        services.attempt_abandon(
            attempt_id=claim.attempt_id, token=claim.token, why="the worker hung up before the claim reached it"
        )
    finally:
        _release()


async def claim_with_wait_async(*, worker_id: str, session: str, max_jobs: int, wait: float) -> list[Claim]:
    """The long-poll on the event loop: claim rounds run in the claim pool."""
    steps = _steps(worker_id=worker_id, session=session, max_jobs=max_jobs, wait=wait)
    answer = None
    try:
        while True:
            kind, arg = steps.send(answer)
            if kind == "claim":
                answer = await _claim_round_shielded(arg)
            else:
                answer = await arg[0].wait_async(arg[1])
    except StopIteration as done:
        return done.value
    finally:
        steps.close()

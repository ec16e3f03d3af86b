"""A finish that claims the worker's next job in its own transaction.

A worker thread that has just finished a job usually wants another. As two
services, that is two transactions and, in the embedded worker, a hand-off
to the claim loop in between; here the claim runs in the finish's
transaction, after the finish has freed the attempt's slot (the claim counts
the worker's live attempts against its capacity). The claim is the plain
claim (claiming._claim): the same eligibility, limits, order and fencing.

A claim refused for the worker (its registration gone or taken over by a
newer process, which the claim finds before it writes anything) answers no
claims and leaves the finish to commit; the claim loop's next claim meets the
same refusal and acts on it. Any other error of the claim fails the whole call,
finish included, as one transaction must: nothing of it is written, and the
worker runtime then sends the finish again on its own (workers/runtime.py).
"""

import dataclasses

from ..clock import Clock
from ..exceptions import NotFound, SessionSuperseded
from ..types import Claim
from .attempts import attempt_finish
from .claiming import _claim, requirement_cache
from .common import service

_CLAIM_ARGUMENTS = frozenset({"worker_id", "session", "max_jobs"})


@dataclasses.dataclass(frozen=True)
class Finished:
    """A finish's answer (the job's new state) and the jobs claimed with it."""

    job_state: str
    claims: list[Claim]


def _finish_and_claim_many(calls: list[dict]) -> list[tuple[object, Exception | None]]:
    """Many calls in the caller's transaction (group commit): every finish first, together
    (attempt_finish's `many`), then one claim per worker for the jobs that all its finished
    calls asked for, shared out in the calls' order."""
    answers = attempt_finish.body.many([_finish_of(kw) for kw in calls])
    finished = [i for i, (_, refused) in enumerate(answers) if refused is None]
    claims = _claims_for([calls[i] for i in finished])
    return [
        (None, refused) if refused is not None else (Finished(state, claims.pop(0)), None)
        for state, refused in answers
    ]


def _finish_of(call: dict) -> dict:
    return {k: v for k, v in call.items() if k not in _CLAIM_ARGUMENTS}


def _claims_for(calls: list[dict]) -> list[list[Claim]]:
    """The claims of each of `calls` (finished): one claim per worker for all that its calls ask."""
    by_worker: dict[tuple[str, str], list[int]] = {}
    for i, call in enumerate(calls):
        if call.get("max_jobs", 1) > 0:
            by_worker.setdefault((call["worker_id"], call["session"]), []).append(i)
    answer: list[list[Claim]] = [[] for _ in calls]
    for (worker_id, session), indexes in by_worker.items():
        asked = sum(calls[i].get("max_jobs", 1) for i in indexes)
        try:
            claims = _claim(worker_id, session, asked, calls[indexes[0]].get("clock")).claims
        except (NotFound, SessionSuperseded):  # refused before the claim wrote anything: the finishes stand
            continue
        except BaseException:
            # The transaction goes: a job class the finish made (a follow-up's) and the claim
            # read into the process's cache goes with it, and its id may be reused.
            requirement_cache.reset()
            raise
        for i in indexes:
            n = calls[i].get("max_jobs", 1)
            answer[i], claims = claims[:n], claims[n:]
    return answer


@service(many=_finish_and_claim_many)
def attempt_finish_and_claim(
    *,
    attempt_id: int,
    token: str,
    outcome: str,
    summary: dict | None = None,
    error: str | None = None,
    worker_id: str,
    session: str,
    max_jobs: int = 1,
    clock: Clock | None = None,
) -> Finished:
    """attempt_finish, then, in the same transaction, jobs_claim of up to `max_jobs` (0: none)
    for the worker; the finish's answer and the claims. A finish refused raises as
    attempt_finish's does, and claims nothing."""
    job_state = attempt_finish.body(
        attempt_id=attempt_id, token=token, outcome=outcome, summary=summary, error=error, clock=clock
    )
    call = {"worker_id": worker_id, "session": session, "max_jobs": max_jobs, "clock": clock}
    return Finished(job_state, _claims_for([call])[0])

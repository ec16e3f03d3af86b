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

The finish also carries the job's last writes — its last journal record, the
final chunks of its quiet steps' logs — under its own fence: one read of the
attempt for all of them, where each as a call of its own reads it again.
"""

import dataclasses
from collections.abc import Sequence

from ..clock import Clock
from ..exceptions import InvalidRequest, NotFound, SessionSuperseded
from ..types import Claim
from . import attempts, logs, records
from .claiming import _claim, requirement_cache
from .common import service

_CLAIM_ARGUMENTS = frozenset({"worker_id", "session", "max_jobs"})
_CARRIED = frozenset({"record", "log_ends"})


@dataclasses.dataclass(frozen=True)
class Finished:
    """A finish's answer (the job's new state), the jobs claimed with it, and why any write it
    carried was refused (the finish stands without it)."""

    job_state: str
    claims: list[Claim]
    refused: tuple[str, ...] = ()


def _finish_and_claim_many(calls: list[dict]) -> list[tuple[object, Exception | None]]:
    """Many calls in the caller's transaction (group commit): every finish first, together
    (attempts.finish_many, which writes what each carries after its fence), then one claim per
    worker for the jobs that all its finished calls asked for, shared out in the calls' order."""
    carry, refused = _carrier(calls)
    answers = attempts.finish_many([_finish_of(kw) for kw in calls], carry)
    finished = [i for i, (_, error) in enumerate(answers) if error is None]
    claims = _claims_for([calls[i] for i in finished])
    return [
        (None, error) if error is not None else (Finished(state, claims.pop(0), tuple(refused[i])), None)
        for i, (state, error) in enumerate(answers)
    ]


def _finish_of(call: dict) -> dict:
    return {k: v for k, v in call.items() if k not in _CLAIM_ARGUMENTS and k not in _CARRIED}


def _carrier(calls: list[dict]) -> tuple[attempts.Carry | None, list[list[str]]]:
    """The carry of finish_many for `calls` (None when none carries a write), and per call the
    refusals it met: a carried write that the queue's rules refuse (InvalidRequest: a full
    journal, a log past its limits, a malformed one), which writes nothing before it is
    refused, is left out and named, and the finish and the other writes stand. Any other
    error (Unavailable: a concurrent append) fails the call, to be sent again whole."""
    refused: list[list[str]] = [[] for _ in calls]
    if not any(call.get("record") or call.get("log_ends") for call in calls):
        return None, refused

    def carry(i: int, cursor, fenced, now) -> None:
        call = calls[i]
        record = call.get("record")
        if record:
            try:
                record = _object(record, "record", "key, state and value")
                records.write_fenced(fenced, key=record.get("key"), state=record.get("state"), value=record.get("value"), now=now)
            except InvalidRequest as exc:
                refused[i].append(f"record {_name(record, 'key')}: {exc}")
        for end in call.get("log_ends") or ():
            try:
                end = _object(end, "log_ends", "stream, offset and text")
                logs.append_fenced(
                    cursor, fenced, attempt_id=call["attempt_id"], stream=end.get("stream"), offset=end.get("offset"),
                    text=end.get("text"), final=True, now=now,
                )  # fmt: skip
            except InvalidRequest as exc:
                refused[i].append(f"log stream {_name(end, 'stream')}: {exc}")

    return carry, refused


def _object(item, field: str, keys: str) -> dict:
    if not isinstance(item, dict):
        raise InvalidRequest(f"a carried {field} item must be an object of {keys}", field=field)
    return item


def _name(item, key: str) -> str:
    """What a refusal calls a carried write: its key or stream, else the item itself."""
    return f"{item.get(key) if isinstance(item, dict) else item!r:.80}"


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
    record: dict | None = None,
    log_ends: Sequence[dict] = (),
    clock: Clock | None = None,
) -> Finished:
    """attempt_finish, then, in the same transaction, jobs_claim of up to `max_jobs` (0: none)
    for the worker; the finish's answer and the claims. A finish refused raises as
    attempt_finish's does, and claims nothing.

    The finish carries its job's last writes, made under its fence (one read of the attempt
    for all): `record` ({key, state, value}: job_record's) and `log_ends` ([{stream, offset,
    text}]: each log_append's final chunk), written before the attempt is settled, as the calls
    would be. A finish sent again after it was committed writes them no more."""
    call = {"attempt_id": attempt_id, "token": token, "outcome": outcome, "summary": summary, "error": error,
            "clock": clock, "record": record, "log_ends": log_ends}  # fmt: skip
    carry, refused = _carrier([call])
    job_state = attempts.finish_one(_finish_of(call), carry)
    claim = {"worker_id": worker_id, "session": session, "max_jobs": max_jobs, "clock": clock}
    return Finished(job_state, _claims_for([claim])[0], tuple(refused[0]))

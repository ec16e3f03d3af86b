"""The claim: lease the best eligible queued jobs to a worker, in one transaction.

Eligibility is DESIGN §3.3: pool, labels, capabilities, the affinity pin,
limits counted from live attempts, capacity, ready and not draining. The
claim decides in Python which job classes (requirement sets) this worker may
take now, then walks the claim-order index of each such class only, so its
cost does not grow with the queued jobs the worker cannot take.
"""

import dataclasses
import datetime as dt
import hashlib
import hmac
import secrets
import threading
import time
from collections import Counter

from django.db import connection

from .. import conf, sql
from ..clock import Clock
from ..exceptions import NotFound, SessionSuperseded
from ..models import JOB_TRANSITIONS, JobState, RequirementSet
from ..types import Claim
from ..wakeup import notifier
from .affinity import pin
from .common import hash_token, now_of, postgres, service
from .transitions import LostUpdate, check_transition

CANDIDATE_SPARES = 8  # PostgreSQL: extra candidates per claim, for rows other claimers hold locked
UNION_TERMS = 400  # classes walked per candidate statement (SQLite's compound SELECT limit is 500)


class RequirementCache:
    """Requirement sets (job classes) are immutable and never deleted, so each
    process keeps the ones it has seen and asks only for what it has not.

    On PostgreSQL ids are handed out at insert and become visible at commit,
    so a set can appear *below* the highest id already seen. Ids skipped that
    way are remembered as gaps and asked for again on every call until they
    show up, or for GAP_SECONDS (a rolled-back insert leaves a gap for good).
    Shared by the threads of a process (the listener's claim pool, the daemon's worker):
    the lock guards the state, never a query."""

    GAP_SECONDS = 300.0

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.sets: dict[int, tuple[str | None, frozenset, frozenset, dict[str, str | None]]] = {}
            self.last_id = 0
            self.gaps: dict[int, float] = {}  # id → monotonic time it was first missed

    def eligible(
        self, cursor, pool: str | None, labels: set[str], capabilities: set[str], newest: int | None
    ) -> list[tuple[int, dict]]:
        """[(set id, its limit keys by dimension)] for the sets this worker satisfies.
        `newest`: the highest set id in the database, read by the claim's first statement;
        when this process has seen it and misses none below it, nothing is read."""
        with self.lock:
            last_id, gaps = self.last_id, sorted(self.gaps)
            known = list(self.sets.items()) if (newest or 0) <= last_id and not gaps else None
        if known is None:
            known = self._read(cursor, last_id, gaps)
        return self._met(known, pool, labels, capabilities)

    def _read(self, cursor, last_id: int, gaps: list[int]) -> list:
        """The sets newer than `last_id` or among `gaps`, added to what the process keeps; all it keeps."""
        cursor.execute(sql.requirement_sets(len(gaps)), [last_id, *gaps])
        rows = cursor.fetchall()
        now = time.monotonic()
        with self.lock:
            for pk, need_pool, need_labels, need_caps, project, source, agent, runner in rows:
                keys = {"project": project, "source": source, "agent": agent, "runner": runner, "pool": need_pool}
                self.sets[pk] = (need_pool, frozenset(sql.from_js(need_labels)), frozenset(sql.from_js(need_caps)), keys)
                self.gaps.pop(pk, None)
            read_up_to = max((row[0] for row in rows), default=0)
            for missing in range(self.last_id + 1, read_up_to):
                if missing not in self.sets:
                    self.gaps.setdefault(missing, now)
            self.last_id = max(self.last_id, read_up_to)
            for pk, since in list(self.gaps.items()):
                if now - since > self.GAP_SECONDS:
                    del self.gaps[pk]
            return list(self.sets.items())

    @staticmethod
    def _met(known: list, pool: str | None, labels: set[str], capabilities: set[str]) -> list[tuple[int, dict]]:
        return [
            (pk, keys)
            for pk, (need_pool, need_labels, need_caps, keys) in known
            if RequirementSet.met(need_pool, need_labels, need_caps, pool=pool, labels=labels, capabilities=capabilities)
        ]

    def shape(self, pk: int) -> tuple[str | None, frozenset, frozenset] | None:
        """What set `pk` requires (pool, labels, capabilities); None when not seen yet."""
        with self.lock:
            known = self.sets.get(pk)
        return None if known is None else known[:3]


requirement_cache = RequirementCache()
notifier.resolve = requirement_cache.shape  # the notifier matches wakes of a job class to waiting workers


@dataclasses.dataclass(frozen=True)
class Round:
    """One claim transaction's result, with what a long-poll needs to wait:
    the worker's shape, and whether it came back empty for want of jobs
    (rather than for want of capacity, readiness, or while draining)."""

    claims: list[Claim]
    shape: tuple[str | None, frozenset, frozenset]
    starved: bool
    contended: bool = False  # PostgreSQL: jobs passed over because another claim held their lock


def _live_counts(cursor, dimensions: tuple[str, ...], n_ow, only: list[tuple[str, str, int]] = ()) -> Counter:
    """Live (active, unexpired) attempts per (dimension, key), counted from the
    attempts themselves inside the claim: no counter that a crashed worker could leak."""
    statement = sql.live_counts(dimensions, tuple(d for d, _, _ in only))
    cursor.execute(statement, [n_ow, *(k for _, k, _ in only)])
    counts: Counter = Counter()
    for row in cursor.fetchall():
        for d, key in zip(dimensions, row[:-1], strict=True):
            counts[(d, key)] += row[-1]
    return counts


def _lock_limit_keys(cursor, keys: list[tuple[str, str, int]]) -> bool:
    """PostgreSQL: a transaction-scoped advisory lock per limited key, so two
    claims touching the same key are serialised and count each other's
    attempts. try-locks never wait, so they cannot deadlock; a key another
    claimer holds skips this job for now, as skip_locked skips a locked row."""
    ids = sorted(
        int.from_bytes(hashlib.blake2b(f"apiary-limit:{d}:{k}".encode(), digest_size=8).digest(), "big", signed=True)
        for d, k, _ in keys
    )
    cursor.execute(sql.LOCK_LIMIT_KEYS, [ids])
    return bool(cursor.fetchone()[0])


@service
def jobs_claim(*, worker_id: str, session: str, max_jobs: int = 1, clock: Clock | None = None) -> list[Claim]:
    """Lease up to `max_jobs` eligible queued jobs to the worker (never beyond
    its free capacity), best first: priority, then age. [] when there is none."""
    return _claim(worker_id, session, max_jobs, clock).claims


@service
def claim_round(*, worker_id: str, session: str, max_jobs: int = 1, clock: Clock | None = None) -> Round:
    """jobs_claim, for a long-poll: the claims and what it needs to wait."""
    return _claim(worker_id, session, max_jobs, clock)


def _claim(worker_id: str, session: str, max_jobs: int, clock: Clock | None) -> Round:
    now = now_of(clock)
    cfg = conf.current()
    on_postgres = postgres()
    n_ow = sql.ts(now)
    with connection.cursor() as cursor:
        if on_postgres:
            # Serialise claims of one worker, then count its attempts in a new
            # statement: READ COMMITTED gives each statement a fresh snapshot,
            # but a sub-select in the locking statement would still see the
            # world from before it waited for the lock.
            cursor.execute(sql.LOCK_WORKER, [worker_id])
        row = sql.one(cursor, sql.WORKER_FOR_CLAIM, [n_ow, worker_id])
        if row is None:
            raise NotFound(f"worker {worker_id!r} is not registered", worker_id=worker_id)
        w_session, pool, labels, capabilities, capacity, draining, ready, drain_requested, busy, newest_class = row
        if not hmac.compare_digest(w_session, session):
            raise SessionSuperseded(f"worker {worker_id!r} was registered again by a newer process", worker_id=worker_id)
        labels, capabilities = frozenset(sql.from_js(labels)), frozenset(sql.from_js(capabilities))
        shape = (pool, labels, capabilities)
        wanted = min(max_jobs, capacity - busy)
        if draining or drain_requested or not ready or wanted <= 0:
            return Round([], shape, starved=False)
        eligible = requirement_cache.eligible(cursor, pool, set(labels), set(capabilities), newest_class)
        if not eligible:
            return Round([], shape, starved=True)
        limits = cfg.limits
        dimensions = limits.active_dimensions()
        counts = _live_counts(cursor, dimensions, n_ow) if dimensions else Counter()

        claims: list[Claim] = []
        passed_over: set[int] = set()
        contended = False
        for _round in range(4):  # each round claims or passes over ≥1 job; a short answer is fine
            want = wanted - len(claims)
            open_sets = [
                pk for pk, keys in eligible
                if not any(counts[(d, keys[d])] >= limits.limit(d, keys[d]) > 0 for d in dimensions)
            ]
            batch, locked, more = _candidates(cursor, open_sets, worker_id, n_ow, passed_over, want) if open_sets else ([], [], False)
            if locked:  # held by other claims (PostgreSQL): walk past them next round
                passed_over.update(locked)
                contended = True
            chosen: list[dict] = []
            pending: Counter = Counter()
            for cand in batch:
                keys = [(d, cand[d], lim) for d in dimensions if (lim := limits.limit(d, cand[d])) > 0]
                if keys and on_postgres:
                    if not _lock_limit_keys(cursor, keys):
                        passed_over.add(cand["id"])
                        contended = True
                        continue
                    fresh = _live_counts(cursor, dimensions, n_ow, keys)  # recounted under the lock
                    for d, k, _ in keys:  # and this round's choices, leased only at its end
                        counts[(d, k)] = fresh[(d, k)] + pending[(d, k)]
                if any(counts[(d, k)] >= lim for d, k, lim in keys):
                    passed_over.add(cand["id"])
                    continue
                if cand["affinity_key"] is not None and not (pinned := pin(cursor, cand["affinity_key"], worker_id, now)):
                    passed_over.add(cand["id"])  # pinned elsewhere, or (None) another claim holds the key's lock
                    contended = contended or pinned is None
                    continue
                chosen.append(cand)
                for d, k, _ in keys:
                    counts[(d, k)] += 1
                    pending[(d, k)] += 1
            claims += _lease(cursor, chosen, worker_id, w_session, now, cfg)
            if not more or len(claims) == wanted:
                break
        return Round(claims, shape, starved=not claims and not contended, contended=contended and not claims)


def _candidates(
    cursor, classes: list[int], worker_id: str, n_ow, passed_over: set[int], want: int
) -> tuple[list[dict], list[int], bool]:
    """Up to `want` claimable jobs of the given classes, best first; the ids
    walked but found locked by another claim (PostgreSQL), and whether the
    classes may hold more jobs than were walked.

    Each class is walked on its own through the partial index
    (requirements, -priority, available_at, id) and stops after `want` rows;
    the union of those short walks is merged and cut. Only pinned-elsewhere
    affinity jobs and jobs passed over earlier in this claim are skipped one by
    one. On PostgreSQL the chosen rows are then locked, skipping any another
    claimer holds."""
    on_postgres = postgres()
    # On PostgreSQL concurrent claimers see the same best jobs; a few spare
    # candidates let one that finds them locked take the next ones instead of
    # coming back empty. SQLite claims one at a time: no spares needed.
    walk_limit = want + (CANDIDATE_SPARES if on_postgres else 0)
    skipped = sorted(passed_over)
    found: list[tuple] = []
    # SQLite allows at most 500 terms in one compound SELECT: walk the classes in chunks.
    for first in range(0, len(classes), UNION_TERMS):
        chunk = classes[first : first + UNION_TERMS]
        params = [p for pk in chunk for p in (pk, n_ow, worker_id, *skipped, walk_limit)]
        cursor.execute(sql.candidate_walk(len(chunk), len(skipped), on_postgres), [*params, walk_limit])
        found += cursor.fetchall()
    found.sort(key=lambda row: (-row[1], row[2], row[0]))
    if not on_postgres:  # the walk's rows are the candidates
        rows = [dict(zip(sql.CANDIDATE_COLUMNS, row[3:], strict=True)) for row in found[:want]]
        return rows, [], len(found) >= walk_limit
    ids = [row[0] for row in found[:walk_limit]]
    if not ids:
        return [], [], False
    cursor.execute(sql.candidates(len(ids)), [n_ow, *ids, want])
    rows = [dict(zip(sql.CANDIDATE_COLUMNS, row, strict=True)) for row in cursor.fetchall()]
    # Short of `want` although the walk found enough: the rest were locked (or just claimed).
    # Every row walked up to the last one taken was lockable or is skipped for good.
    locked = []
    if len(rows) < want and len(ids) > len(rows):
        taken = {row["id"] for row in rows}
        locked = [pk for pk in ids if pk not in taken]
    return rows, locked, len(rows) == want or len(found) >= walk_limit


def _lease(cursor, chosen: list[dict], worker_id: str, session: str, now: dt.datetime, cfg: conf.QueueConfig) -> list[Claim]:
    """Lease the chosen candidates, all in one go (sql.lease); their claims, in the same order."""
    if not chosen:
        return []
    check_transition(JOB_TRANSITIONS, JobState.QUEUED, JobState.LEASED)
    tokens = [secrets.token_urlsafe(32) for _ in chosen]  # 256 bits each; only their hashes are stored
    numbers = [cand["attempt_count"] + 1 for cand in chosen]
    expires = now + cfg.lease
    n_ow, until = sql.ts(now), sql.ts(expires)
    statements = sql.lease(len(chosen), postgres())
    if len(statements) == 1:  # PostgreSQL
        rows = [p for cand, number, token in zip(chosen, numbers, tokens, strict=True)
                for p in (cand["id"], number, hash_token(token))]  # fmt: skip
        cursor.execute(statements[0], [*rows, worker_id, session, n_ow, until, n_ow, worker_id])
        answered = cursor.fetchall()
        moved = answered[0][2] if answered else 0
        attempt_of = {job_id: attempt_id for attempt_id, job_id, _ in answered}
    else:
        insert_attempts, move_jobs, insert_events = statements
        rows = [p for cand, number, token in zip(chosen, numbers, tokens, strict=True)
                for p in (cand["id"], number, worker_id, session, hash_token(token), n_ow, until)]  # fmt: skip
        cursor.execute(insert_attempts, rows)
        attempt_of = {job_id: attempt_id for attempt_id, job_id in cursor.fetchall()}
        cursor.execute(move_jobs, [p for cand, n in zip(chosen, numbers, strict=True) for p in (cand["id"], attempt_of[cand["id"]], n)])
        moved = cursor.rowcount
        cursor.execute(insert_events, [
            p for cand, n in zip(chosen, numbers, strict=True)
            for p in (cand["id"], "claimed", n_ow, worker_id, attempt_of[cand["id"]], sql.js({"number": n}))
        ])  # fmt: skip
    if moved != len(chosen) or len(attempt_of) != len(chosen):
        raise LostUpdate(f"{len(chosen) - moved} of queue_job {[c['id'] for c in chosen]} were not queued any more (moving to leased)")
    return [
        Claim(
            job_id=cand["id"],
            attempt_id=attempt_of[cand["id"]],
            attempt_number=number,
            token=token,
            lease_expires_at=expires,
            agent=cand["agent"],
            runner=cand["runner"],
            payload=sql.from_js(cand["payload"]),
        )
        for cand, number, token in zip(chosen, numbers, tokens, strict=True)
    ]

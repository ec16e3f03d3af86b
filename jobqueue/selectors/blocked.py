"""Why queued jobs wait: the `blocked` list of the status document.

Cheap on a big queue: queued jobs are grouped in one query and each group is
judged once against the workers (see `blocked_reasons`).
"""

import dataclasses
import datetime as dt
from collections import Counter

from django.db.models import BooleanField, Case, Count, Exists, Min, OuterRef, Subquery, Value, When

from .. import conf
from ..clock import get_clock
from ..conf import DIMENSIONS
from ..models import Affinity, Attempt, AttemptState, Job, JobState, RequirementSet, Worker
from .workers import EXITED, HEALTHY, STALE, active_jobs, worker_health, worker_is_draining, workers_all

# The `blocked` list names at most this many jobs: on a deep queue whose
# workers are all gone, listing every job would make status as slow as the queue is long.
BLOCKED_LIMIT = 100

RUNNER_PREFIX = "runner:"


def rfc3339(value: dt.datetime | None) -> str | None:
    """RFC 3339 in UTC with a `Z`, e.g. 2026-01-01T00:00:00Z (fractions only when present)."""
    if value is None:
        return None
    return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


@dataclasses.dataclass(frozen=True)
class _Group:
    """Queued jobs that every worker treats alike: same requirement set, same
    limit keys, same pin, on the same side of `now`. One verdict serves them all."""

    requirements_id: int
    project: str
    source: str
    agent: str
    runner: str
    pool: str | None
    pin: str | None
    later: bool

    def keys(self) -> dict[str, str | None]:
        return {d: getattr(self, d) for d in DIMENSIONS}


def blocked_reasons(*, now: dt.datetime | None = None, limit: int = BLOCKED_LIMIT) -> list[dict]:
    """[{"job_id", "reason"}] for queued jobs that no registered worker can take
    now, at most `limit` of them, ordered by job id.

    Cheap on a big queue: queued jobs are grouped in one query by (requirement
    set, limit keys, affinity pin, available now or later) and each group is
    judged once against the workers; job ids are then fetched only for blocked
    groups, group by group (oldest group first) until `limit` ids are found —
    so with more blocked jobs than `limit`, the list is a prefix per group,
    not necessarily the globally oldest `limit` jobs."""
    now = now or get_clock().now()
    return blocked_among(now=now, workers=workers_all(), live=active_jobs(now=now), limit=limit)


def blocked_among(*, now: dt.datetime, workers: list[Worker], live: dict[str, int], limit: int) -> list[dict]:
    groups = _queued_groups(now)
    if not groups:
        return []
    cfg = conf.current()
    requirement_sets = RequirementSet.objects.in_bulk({g.requirements_id for g in groups})
    limited = _limit_counts(now, cfg.limits)
    judge = _Judge(now=now, workers=workers, live=live, timeout=cfg.worker_timeout, limits=cfg.limits, counts=limited)
    blocked: list[dict] = []
    for group in groups:
        if len(blocked) >= limit:
            break
        reason = judge.reason(group, requirement_sets[group.requirements_id])
        if reason is None:
            continue
        for job_id, available_at in _group_jobs(group, now, limit - len(blocked)):
            text = reason if reason != _NOT_BEFORE else f"not before {rfc3339(available_at)}"
            blocked.append({"job_id": job_id, "reason": text})
    blocked.sort(key=lambda b: b["job_id"])
    return blocked


def _queued_groups(now: dt.datetime) -> list[_Group]:
    rows = (
        Job.objects.filter(state=JobState.QUEUED)
        .annotate(
            # Only jobs with an affinity key can be pinned.
            pin=Subquery(Affinity.objects.filter(key=OuterRef("affinity_key")).values("worker_id")[:1]),
            later=Case(When(available_at__gt=now, then=Value(True)), default=Value(False), output_field=BooleanField()),
        )
        .values("requirements_id", *DIMENSIONS, "pin", "later")
        .annotate(first=Min("id"))
        .order_by("first")
    )
    return [_Group(**{k: v for k, v in row.items() if k != "first"}) for row in rows]


def _group_jobs(group: _Group, now: dt.datetime, n: int) -> list[tuple[int, dt.datetime]]:
    qs = Job.objects.filter(state=JobState.QUEUED, requirements_id=group.requirements_id, **group.keys())
    pinned = Affinity.objects.filter(key=OuterRef("affinity_key"))
    qs = qs.exclude(Exists(pinned)) if group.pin is None else qs.filter(Exists(pinned.filter(worker_id=group.pin)))
    qs = qs.filter(available_at__gt=now) if group.later else qs.filter(available_at__lte=now)
    return list(qs.order_by("-priority", "available_at", "id").values_list("id", "available_at")[:n])


def _limit_counts(now: dt.datetime, limits: conf.Limits) -> Counter:
    """Live attempts per (dimension, key), as the claim counts them."""
    dimensions = limits.active_dimensions()
    counts: Counter = Counter()
    if not dimensions:
        return counts
    rows = (
        Attempt.objects.filter(state=AttemptState.ACTIVE, lease_expires_at__gt=now)
        .values(*(f"job__{d}" for d in dimensions))
        .annotate(n=Count("id"))
        .order_by()
    )
    for row in rows:
        for d in dimensions:
            counts[(d, row[f"job__{d}"])] += row["n"]
    return counts


_NOT_BEFORE = object()  # replaced by each job's own time


_PLURALS = {"label": "labels", "runner": "runners", "capability": "capabilities"}


def _plural(word: str, items: list[str]) -> str:
    return f"{_PLURALS[word] if len(items) > 1 else word} {', '.join(items)}"


def _some(ids: list[str]) -> str:
    return ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")


@dataclasses.dataclass
class _Judge:
    now: dt.datetime
    workers: list[Worker]
    live: dict[str, int]
    timeout: float
    limits: conf.Limits
    counts: Counter

    def reason(self, group: _Group, req: RequirementSet):
        """Why no worker can take the group's jobs now; None when one can.
        Checked from the most to the least structural: a missing pool or label
        needs an operator, a busy worker only needs time."""
        if group.pin is not None:
            return self._pinned(group, req)
        matching = [w for w in self.workers if _satisfies(req, w)]
        if not matching:
            return _mismatch(req, self.workers)
        health = {w.worker_id: worker_health(w, now=self.now, timeout=self.timeout) for w in matching}
        healthy = [w for w in matching if health[w.worker_id] == HEALTHY]
        if not healthy:
            gone = [
                f"{state}: {_some(ids)}"
                for state in (STALE, EXITED)
                if (ids := [w.worker_id for w in matching if health[w.worker_id] == state])
            ]
            return f"no healthy worker ({'; '.join(gone)})"
        able = [w for w in healthy if w.ready and not worker_is_draining(w)]
        if not able:
            if all(worker_is_draining(w) for w in healthy):
                return "all eligible workers are draining"
            if not any(w.ready for w in healthy):
                return "no eligible worker is ready"
            return "all eligible workers are draining or not ready"
        return self._limit(group) or self._capacity(able, "all eligible workers are at capacity") or self._later(group)

    def _pinned(self, group: _Group, req: RequirementSet):
        prefix = f"pinned to worker {group.pin}"
        worker = next((w for w in self.workers if w.worker_id == group.pin), None)
        if worker is None:
            return f"{prefix} (not registered)"
        lacks = _lacks(req, worker)
        if lacks:
            return f"{prefix} ({lacks})"
        health = worker_health(worker, now=self.now, timeout=self.timeout)
        if health != HEALTHY:
            return f"{prefix} ({health})"
        if worker_is_draining(worker):
            return f"{prefix} (draining)"
        if not worker.ready:
            return f"{prefix} (not ready)"
        return self._limit(group) or self._capacity([worker], f"{prefix} (at capacity)") or self._later(group)

    def _limit(self, group: _Group) -> str | None:
        """The first limit at its number, named with its dimension, key and
        number, e.g. "project limit hello: 2 of 2 running"."""
        for d, key in group.keys().items():
            cap = self.limits.limit(d, key)
            running = self.counts[(d, key)]
            if cap > 0 and running >= cap:
                return f"{d} limit {key}: {running} of {cap} running"
        return None

    def _capacity(self, able: list[Worker], text: str) -> str | None:
        return None if any(self.live.get(w.worker_id, 0) < w.capacity for w in able) else text

    def _later(self, group: _Group):
        return _NOT_BEFORE if group.later else None


def _satisfies(req: RequirementSet, worker: Worker) -> bool:
    return req.satisfied_by(pool=worker.pool, labels=set(worker.labels), capabilities=set(worker.capabilities))


def _lacks(req: RequirementSet, worker: Worker) -> str | None:
    """What one worker lacks for the requirement set, or None."""
    if req.pool is not None and worker.pool != req.pool:
        return f"not in pool {req.pool}"
    labels = [x for x in req.labels if x not in worker.labels]
    if labels:
        return "lacks " + _plural("label", labels)
    runners = [
        x.removeprefix(RUNNER_PREFIX)
        for x in req.capabilities
        if x.startswith(RUNNER_PREFIX) and x not in worker.capabilities
    ]
    if runners:
        return "lacks " + _plural("runner", runners)
    caps = [x for x in req.capabilities if x not in worker.capabilities]
    if caps:
        return "lacks " + _plural("capability", caps)
    return None


def _mismatch(req: RequirementSet, workers: list[Worker]) -> str:
    """Why no registered worker satisfies the requirement set, naming the
    first requirement that nobody (left after the earlier ones) meets."""
    if not workers:
        return f"no worker in pool {req.pool}" if req.pool else "no worker registered"
    candidates = [w for w in workers if req.pool is None or w.pool == req.pool]
    if not candidates:
        return f"no worker in pool {req.pool}"
    where = f" in pool {req.pool}" if req.pool else ""

    def elsewhere(attr: str, items: list[str]) -> str:
        # Say where it is missing only when some worker outside that set has it.
        outside = [w for w in workers if w not in candidates]
        return where if any(x in getattr(w, attr) for w in outside for x in items) else ""

    missing = [x for x in req.labels if not any(x in w.labels for w in candidates)]
    if missing:
        return "missing " + _plural("label", missing) + elsewhere("labels", missing)
    candidates = [w for w in candidates if set(req.labels) <= set(w.labels)]
    if not candidates:
        return f"no worker{where} has " + _plural("label", list(req.labels)) + " together"
    if req.labels:
        where += " with " + _plural("label", list(req.labels))

    runner_caps = [x for x in req.capabilities if x.startswith(RUNNER_PREFIX)]
    missing = [x for x in runner_caps if not any(x in w.capabilities for w in candidates)]
    if missing:
        names = ", ".join(x.removeprefix(RUNNER_PREFIX) for x in missing)
        anywhere = any(x in w.capabilities for w in workers for x in missing)
        return f"runner {names} not available on any worker" + (where if anywhere else "")
    missing = [x for x in req.capabilities if not any(x in w.capabilities for w in candidates)]
    if missing:
        return "missing " + _plural("capability", missing) + elsewhere("capabilities", missing)
    return f"no worker{where} has " + _plural("capability", list(req.capabilities)) + " together"

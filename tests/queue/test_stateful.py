"""Hypothesis drives the queue services at random against a small model.

Rules: enqueue (fresh keys and duplicates), claim, attempt heartbeat and
finish (with the right token, a wrong one, or any token ever issued), cancel
(job or instance, queued or leased), time passing followed by the reaper or
by a claim before the reaper, worker heartbeats
(draining, unready), re-registration (a new session) and calls with the
superseded session, operator drain/undrain, affinity release, and journal
writes (`publish:*` records, started or done, with the current attempt's
token, a finished or stale attempt's, or a wrong one). Some jobs carry
follow-ups (hooks, issue 10): one job per terminal state, which the queue
enqueues as the job settles. Three workers in two pools with different labels
and capabilities share tight limits on every dimension.

Each rule checks the service's answer against the model (a claimed job must
be eligible, the best eligible job must be among those claimed, a short claim
means nothing else was eligible, a stale call raises and changes no row), and
after every step the invariants compare the database with the model: never
two active attempts for a job, no limit or capacity exceeded counting live
attempts, a terminal state never changes, every state change is an edge of
JOB_TRANSITIONS, and no job is lost; the journal is exactly what live
attempts wrote (no record by a stale or wrong token), a done record never
changes (each publish has at most one recorded success), each settled job with
hooks has exactly its outcome's follow-up (and an unsettled one none), and no
job has more than one succeeded attempt (no hook runs twice to success).

Services commit their own durable transactions, so an example cannot be
rolled back: each one starts by deleting every queue row.
"""

import dataclasses
import datetime as dt
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jobqueue import conf, services
from jobqueue.clock import FrozenClock, set_clock
from jobqueue.conf import DIMENSIONS, Limits, QueueConfig
from jobqueue.exceptions import SessionSuperseded, StaleAttempt
from jobqueue.models import (
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATES,
    Affinity,
    Attempt,
    AttemptState,
    Job,
    JobEvent,
    JobRecord,
    JobState,
    RecordState,
    RequirementSet,
    Worker,
)
from jobqueue.types import Retry
from tests.factories import enqueue_job, snapshot
from workflows.models import Task, WorkflowInstance
from workflows.services import affinity_key, enqueue_key

# How a stale token is turned away: stale, or superseded when its worker id has registered again since.
REFUSED = (StaleAttempt, SessionSuperseded)

LEASE = 10.0
LIMITS = Limits(
    defaults={"project": 2},
    overrides={"agent": {"a1": 1}, "runner": {"codex-cli": 1}, "pool": {"build": 1}, "source": {"s2": 1}},
)
WORKERS = {
    "w1": {"pool": None, "labels": {"linux"}, "capabilities": {"apiary.workflow", "runner:shell"}, "capacity": 2},
    "w2": {
        "pool": "build",
        "labels": {"linux", "gpu"},
        "capabilities": {"apiary.workflow", "runner:shell", "runner:codex-cli", "docker"},
        "capacity": 3,
    },
    "w3": {"pool": "build", "labels": set(), "capabilities": {"apiary.workflow", "runner:shell"}, "capacity": 1},
}
TASKS = (("s1", "a.md"), ("s2", "b.md"), ("s1", "c.md"))
WORKFLOWS = ("triage", "fix", "review", "deploy", "docs", "release")
WORKER_IDS = st.sampled_from(["w2", "w1", "w3"])
RETRY = Retry(max_attempts=2, backoff=8.0)
OUTCOMES = (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.CANCELLED)
WRONG_TOKEN = "x" * 43

# Most jobs fit most workers, so claims mostly succeed and the interesting
# paths (limits, capacity, stale tokens) are reached in a few steps. Hypothesis
# favours the first element of a sampled_from, so that one is the busiest
# choice (agent a2 has no limit; max_attempts 1 would fail on the first expiry).
JOB_SPECS = st.fixed_dictionaries(
    {
        # A fresh enqueue key (the next task × workflow), or again one already used.
        "again": st.sampled_from([False, False, False, True]),
        "pick": st.integers(0, 10**6),
        "pool": st.sampled_from([None, None, "build"]),
        "labels": st.sampled_from(
            [frozenset(), frozenset(), frozenset(), frozenset({"linux"}), frozenset({"linux", "gpu"})]
        ),
        "docker": st.sampled_from([False, False, False, False, True]),
        "runner": st.sampled_from(["shell", "shell", "codex-cli"]),
        "project": st.sampled_from(["p1", "p2"]),
        "agent": st.sampled_from(["a2", "a1"]),
        "affinity": st.booleans(),
        "priority": st.integers(0, 2),
        "max_attempts": st.sampled_from([3, 2, 1]),
        "retry": st.sampled_from([True, False]),
        "hooks": st.sampled_from([True, False]),  # follow-ups for each terminal state
    }
)
PUBLISH_KEYS = st.sampled_from(["publish:open-pr", "publish:tag"])
RECORD_STATES = st.sampled_from([RecordState.STARTED, RecordState.DONE])
HOOK_CAPABILITIES = frozenset({"apiary.workflow", "runner:shell"})


@dataclasses.dataclass
class MJob:
    id: int
    task_id: int
    keys: dict  # dimension → limit key
    labels: frozenset
    capabilities: frozenset
    affinity: bool
    priority: int
    max_attempts: int
    retry_max: int
    available_at: dt.datetime
    state: str = JobState.QUEUED
    attempt_count: int = 0
    expiries: int = 0
    failures: int = 0
    cancel_requested: bool = False
    current: int | None = None
    key: str = ""
    hooks: bool = False  # carries a follow-up (a hook job) for each terminal state
    hook_job: int | None = None  # the follow-up enqueued as it settled
    instance: bool = True  # a workflow instance's job (hook jobs are not)

    @property
    def rank(self):
        return (-self.priority, self.available_at, self.id)


@dataclasses.dataclass
class MAttempt:
    id: int
    job_id: int
    worker_id: str
    token: str
    lease_expires_at: dt.datetime
    number: int = 0
    state: str = AttemptState.ACTIVE
    job_state_after: str = ""  # what its finish answered


@dataclasses.dataclass
class MRecord:
    state: str
    value: dict
    attempt_number: int
    started_by: int | None


@dataclasses.dataclass
class MWorker:
    session: str
    old_sessions: list = dataclasses.field(default_factory=list)
    draining: bool = False
    ready: bool = True
    drain_requested: bool = False


def _wipe() -> None:
    JobEvent.objects.all().delete()
    Job.objects.all().delete()  # and their attempts
    Affinity.objects.all().delete()
    RequirementSet.objects.all().delete()
    Worker.objects.all().delete()
    WorkflowInstance.objects.all().delete()
    Task.objects.all().delete()
    services.requirement_cache.reset()


class QueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        _wipe()
        self.clock = FrozenClock()
        self._previous_clock = set_clock(self.clock)
        self._previous_config = conf.configure(QueueConfig(lease_duration=LEASE, limits=LIMITS))
        now = self.clock.now()
        self.tasks = [
            Task.objects.create(source=source, item_key=item, created_at=now, updated_at=now) for source, item in TASKS
        ]
        self.jobs: dict[int, MJob] = {}
        self.by_key: dict[tuple[int, str], int] = {}
        self.attempts: list[MAttempt] = []  # every attempt ever issued, tokens included
        self.pins: dict[int, str] = {}
        self.workers: dict[str, MWorker] = {}
        for worker_id in WORKERS:
            self.workers[worker_id] = MWorker(session=self._register(worker_id).session)
        self.seen_states: dict[int, str] = {}
        self.records: dict[tuple[int, str], MRecord] = {}  # what live attempts wrote
        self.seen_done: dict[tuple[int, str], tuple] = {}

    def teardown(self):
        set_clock(self._previous_clock)
        conf.configure(self._previous_config)

    # ------------------------------------------------------------------ model helpers

    @property
    def now(self) -> dt.datetime:
        return self.clock.now()

    def _register(self, worker_id: str) -> Worker:
        spec = WORKERS[worker_id]
        return services.worker_register(
            worker_id=worker_id,
            pool=spec["pool"],
            labels=spec["labels"],
            capabilities=spec["capabilities"],
            capacity=spec["capacity"],
        )

    def _live(self, a: MAttempt) -> bool:
        return a.state == AttemptState.ACTIVE and self.jobs[a.job_id].current == a.id and a.lease_expires_at > self.now

    def _live_counts(self) -> tuple[Counter, Counter]:
        per_key, per_worker = Counter(), Counter()
        for a in self.attempts:
            if self._live(a):
                per_worker[a.worker_id] += 1
                for d, k in self.jobs[a.job_id].keys.items():
                    per_key[(d, k)] += 1
        return per_key, per_worker

    def _eligible(self, job: MJob, worker_id: str, per_key: Counter) -> bool:
        spec = WORKERS[worker_id]
        return (
            job.state == JobState.QUEUED
            and job.available_at <= self.now
            and (job.keys["pool"] is None or job.keys["pool"] == spec["pool"])
            and job.labels <= spec["labels"]
            and job.capabilities <= spec["capabilities"]
            and (not job.affinity or self.pins.get(job.task_id, worker_id) == worker_id)
            and all(per_key[(d, k)] < limit for d, k in job.keys.items() if (limit := LIMITS.limit(d, k)) > 0)
        )

    def _expect_unchanged(self, call, error):
        before = snapshot(), list(JobRecord.objects.order_by("pk").values())
        with pytest.raises(error):
            call()
        assert (snapshot(), list(JobRecord.objects.order_by("pk").values())) == before

    def _settled(self, job: MJob) -> None:
        """The job reached a terminal state: its follow-up for that state is queued (in the model)."""
        if not job.hooks or job.state not in TERMINAL_JOB_STATES or job.hook_job is not None:
            return
        row = Job.objects.get(key=f"{job.key}:hook:{job.state}")
        task = next(t for t in self.tasks if t.pk == job.task_id)
        job.hook_job = row.pk
        self.jobs[row.pk] = MJob(
            id=row.pk,
            task_id=job.task_id,
            keys={"project": "p1", "source": task.source, "agent": "a2", "runner": "shell", "pool": None},
            labels=frozenset(),
            capabilities=HOOK_CAPABILITIES,
            affinity=False,
            priority=0,
            max_attempts=2,
            retry_max=RETRY.max_attempts,
            available_at=row.available_at,
            key=row.key,
            instance=False,
        )

    def _expire_in_model(self, a: MAttempt) -> None:
        a.state = AttemptState.EXPIRED
        job = self.jobs[a.job_id]
        if job.current != a.id or job.state != JobState.LEASED:
            return
        job.expiries += 1
        if job.cancel_requested:
            job.state = JobState.CANCELLED
        elif job.expiries >= job.max_attempts:  # max_attempts counts expiries, not failed finishes
            job.state = JobState.FAILED
        else:
            job.state, job.available_at, job.current = JobState.QUEUED, self.now, None
        self._settled(job)

    # ------------------------------------------------------------------ rules

    @initialize(specs=st.lists(JOB_SPECS, min_size=3, max_size=8))
    def a_queue_to_start_with(self, specs):
        for spec in specs:
            self._enqueue_one(**spec)

    @precondition(lambda self: sum(j.state == JobState.QUEUED for j in self.jobs.values()) < 6)
    @rule(specs=st.lists(JOB_SPECS, min_size=1, max_size=3))
    def enqueue(self, specs):
        for spec in specs:
            self._enqueue_one(**spec)

    def _enqueue_one(
        self, again, pick, pool, labels, docker, runner, project, agent, affinity, priority, max_attempts, retry, hooks
    ):
        n = len(self.by_key)
        if again or n == len(TASKS) * len(WORKFLOWS):
            if not n:
                return
            task_id, workflow = sorted(self.by_key)[pick % n]
            task = next(t for t in self.tasks if t.pk == task_id)
        else:
            task, workflow = self.tasks[n % len(TASKS)], WORKFLOWS[n // len(TASKS)]
        existing = self.by_key.get((task.pk, workflow))
        assert bool(existing) == bool(again or n == len(TASKS) * len(WORKFLOWS))
        before = snapshot() if existing else None
        job, created = enqueue_job(
            task,
            workflow=workflow,
            agent=agent,
            runner=runner,
            project=project,
            pool=pool,
            labels=labels,
            capabilities=["docker"] if docker else [],
            affinity=affinity,
            priority=priority,
            max_attempts=max_attempts,
            retry=RETRY if retry else None,
            follow_ups=self._hook_specs(task, workflow) if hooks else None,
        )
        if existing:
            assert (job.pk, created) == (existing, False)
            assert snapshot() == before
            return
        assert created
        self.by_key[(task.pk, workflow)] = job.pk
        self.jobs[job.pk] = MJob(
            id=job.pk,
            task_id=task.pk,
            keys={"project": project, "source": task.source, "agent": agent, "runner": runner, "pool": pool},
            labels=labels,
            capabilities=frozenset({"apiary.workflow", f"runner:{runner}", *(["docker"] if docker else [])}),
            affinity=affinity,
            priority=priority,
            max_attempts=max_attempts,
            retry_max=RETRY.max_attempts if retry else 1,
            available_at=self.now,
            key=job.key,
            hooks=hooks,
        )

    def _hook_specs(self, task: Task, workflow: str) -> dict:
        """A follow-up job per terminal state, as dispatch makes hooks (key `<job key>:hook:<state>`)."""
        key = enqueue_key(task, workflow)
        return {
            state: [
                {
                    "key": f"{key}:hook:{state}", "payload": {"hook": str(state)}, "project": "p1",
                    "source": task.source, "agent": "a2", "runner": "shell", "capabilities": sorted(HOOK_CAPABILITIES),
                    "max_attempts": 2, "retry": dataclasses.asdict(RETRY),
                }
            ]
            for state in TERMINAL_JOB_STATES
        }  # fmt: skip

    @rule(worker_id=WORKER_IDS, max_jobs=st.sampled_from([3, 1, 2]))
    def claim(self, worker_id, max_jobs):
        w = self.workers[worker_id]
        per_key, per_worker = self._live_counts()
        blocked = w.draining or not w.ready or w.drain_requested
        wanted = 0 if blocked else max(0, min(max_jobs, WORKERS[worker_id]["capacity"] - per_worker[worker_id]))
        eligible = sorted(
            (j for j in self.jobs.values() if self._eligible(j, worker_id, per_key)), key=lambda j: j.rank
        )
        claims = services.jobs_claim(worker_id=worker_id, session=w.session, max_jobs=max_jobs)
        assert len(claims) <= wanted
        if claims:
            assert claims[0].job_id == eligible[0].id  # the best eligible job is taken first
        for c in claims:
            job = self.jobs[c.job_id]
            assert self._eligible(job, worker_id, per_key), f"job {job} was not eligible for {worker_id}"
            assert c.attempt_number == job.attempt_count + 1
            assert c.lease_expires_at == self.now + dt.timedelta(seconds=LEASE)
            assert all(c.token != a.token for a in self.attempts)
            job.state, job.current, job.attempt_count = JobState.LEASED, c.attempt_id, job.attempt_count + 1
            self.attempts.append(MAttempt(c.attempt_id, job.id, worker_id, c.token, c.lease_expires_at, c.attempt_number))
            if job.affinity:
                self.pins.setdefault(job.task_id, worker_id)
            for d, k in job.keys.items():
                per_key[(d, k)] += 1
        if len(claims) < wanted:  # a short answer means nothing else was eligible
            left = [j.id for j in self.jobs.values() if self._eligible(j, worker_id, per_key)]
            assert left == [], f"{worker_id} got {len(claims)} of {wanted} while {left} were eligible"

    # An attempt call goes mostly to a live attempt (to one whose job was
    # cancelled, when asked and there is one), else to one that already
    # finished, or to any attempt ever issued (its token may be long stale);
    # sometimes it carries a wrong token. One tuple argument: Hypothesis tries
    # rules with fewer arguments first, and these are the worker's daily work.
    TARGET = st.tuples(
        st.sampled_from(["live", "live", "cancel requested", "finished", "any"]),
        st.integers(0, 10**6),
        st.sampled_from([False, False, False, True]),
    )

    def _choose(self, which: str, pick: int) -> MAttempt:
        chosen = [a for a in self.attempts if self._live(a)]
        if which == "cancel requested":
            chosen = [a for a in chosen if self.jobs[a.job_id].cancel_requested] or chosen
        elif which == "finished":
            chosen = [a for a in self.attempts if a.job_state_after]
        chosen = chosen if which != "any" and chosen else self.attempts
        return chosen[pick % len(chosen)]

    @precondition(lambda self: self.attempts)
    @rule(to=TARGET)
    def heartbeat(self, to):
        which, pick, wrong_token = to
        a = self._choose(which, pick)
        self._heartbeat(a, WRONG_TOKEN if wrong_token else a.token, stale=wrong_token or not self._live(a))

    @precondition(lambda self: self.attempts)
    @rule(to=st.tuples(TARGET, st.sampled_from(OUTCOMES)))
    def finish(self, to):
        (which, pick, wrong_token), outcome = to
        a = self._choose(which, pick)
        self._finish(a, WRONG_TOKEN if wrong_token else a.token, outcome, wrong_token)

    def _heartbeat(self, a: MAttempt, token: str, stale: bool):
        call = lambda: services.attempt_heartbeat(attempt_id=a.id, token=token)  # noqa: E731
        if stale:
            self._expect_unchanged(call, REFUSED)
            return
        hb = call()
        assert hb.cancel == self.jobs[a.job_id].cancel_requested
        assert hb.lease_expires_at == self.now + dt.timedelta(seconds=LEASE)
        a.lease_expires_at = hb.lease_expires_at

    def _finish(self, a: MAttempt, token: str, outcome: str, wrong_token: bool):
        job = self.jobs[a.job_id]
        call = lambda: services.attempt_finish(attempt_id=a.id, token=token, outcome=outcome)  # noqa: E731
        if not wrong_token and a.state == outcome and a.job_state_after:  # the same finish again
            before = snapshot()
            assert call() == a.job_state_after
            assert snapshot() == before
            return
        if wrong_token or not self._live(a):
            self._expect_unchanged(call, REFUSED)
            return
        if job.cancel_requested or outcome == AttemptState.CANCELLED:
            expected = JobState.CANCELLED
        elif outcome == AttemptState.SUCCEEDED:
            expected = JobState.SUCCEEDED
        else:
            job.failures += 1
            expected = JobState.QUEUED if job.failures < job.retry_max else JobState.FAILED
        assert call() == expected
        a.state, a.job_state_after, job.state = outcome, expected, expected
        self._settled(job)
        if expected == JobState.QUEUED:
            job.current = None
            job.available_at = Job.objects.get(pk=job.id).available_at
            backoff = dt.timedelta(seconds=RETRY.backoff)
            assert self.now + backoff / 2 <= job.available_at <= self.now + backoff

    @rule(
        seconds=st.sampled_from([2.0, 0.5, 4.0, LEASE + 1, 0.0]),
        then=st.sampled_from(["reap", "nothing", "claim"]),
        worker_id=WORKER_IDS,
    )
    def time_passes(self, seconds, then, worker_id):
        """The clock moves; then the control plane reaps expired leases, or
        nothing happens, or a claim comes in before the reaper (expired,
        unreaped attempts must not hold a limit slot or capacity)."""
        self.clock.advance(seconds)
        if then == "claim":
            self.claim(worker_id, 3)
        if then != "reap":
            return
        due = [a for a in self.attempts if a.state == AttemptState.ACTIVE and a.lease_expires_at <= self.now]
        expired = services.leases_expire()
        assert sorted(x.pk for x in expired) == sorted(a.id for a in due)
        for a in due:
            self._expire_in_model(a)

    @rule(
        worker_id=WORKER_IDS,
        what=st.sampled_from(["heartbeat", "heartbeat", "heartbeat", "draining", "unready", "register", "superseded"]),
    )
    def worker_event(self, worker_id, what):
        """The worker heartbeats (maybe draining or unready), registers again
        (a restarted process), or a call arrives with a superseded session."""
        w = self.workers[worker_id]
        if what == "register":
            self._register_again(worker_id)
        elif what == "superseded":
            if not w.old_sessions:
                return
            old = w.old_sessions[-1]
            self._expect_unchanged(
                lambda: services.worker_heartbeat(worker_id=worker_id, session=old), SessionSuperseded
            )
            self._expect_unchanged(
                lambda: services.jobs_claim(worker_id=worker_id, session=old, max_jobs=3), SessionSuperseded
            )
        else:
            w.draining, w.ready = what == "draining", what != "unready"
            worker = services.worker_heartbeat(
                worker_id=worker_id, session=w.session, draining=w.draining, ready=w.ready
            )
            assert worker.drain_requested == w.drain_requested

    def _register_again(self, worker_id):
        w = self.workers[worker_id]
        held = [a for a in self.attempts if a.worker_id == worker_id and a.state == AttemptState.ACTIVE]
        session = self._register(worker_id).session
        assert session != w.session
        w.old_sessions.append(w.session)
        w.session, w.draining, w.ready, w.drain_requested = session, False, True, False
        for a in held:  # the old process is gone: its attempts end at once
            self._expire_in_model(a)

    @rule(
        what=st.sampled_from(
            ["undrain", "cancel leased job", "release affinity", "cancel job", "cancel instance", "drain", "undrain"]
        ),
        pick=st.integers(0, 10**6),
    )
    def operator(self, what, pick):
        """An operator cancels a job or an instance, drains or undrains a
        worker, or releases a task's affinity pin."""
        if what.startswith("cancel"):
            leased = [j for j in self.jobs.values() if j.state == JobState.LEASED]
            candidates = leased if what == "cancel leased job" and leased else list(self.jobs.values())
            if candidates:
                self._cancel(candidates[pick % len(candidates)], by_instance=what == "cancel instance")
        elif what == "release affinity":
            task_id = self.tasks[pick % len(self.tasks)].pk
            assert services.affinity_release(key=affinity_key(task_id)) == (task_id in self.pins)
            self.pins.pop(task_id, None)
        else:
            worker_id = sorted(WORKERS)[pick % len(WORKERS)]
            (services.worker_drain if what == "drain" else services.worker_undrain)(worker_id=worker_id)
            self.workers[worker_id].drain_requested = what == "drain"

    def _cancel(self, job: MJob, by_instance: bool):
        if by_instance and job.instance:
            instance = WorkflowInstance.objects.get(job_id=job.id)
            call = lambda: services.job_cancel(job_id=instance.job_id)  # noqa: E731
        else:
            call = lambda: services.job_cancel(job_id=job.id)  # noqa: E731
        if job.state in TERMINAL_JOB_STATES or job.cancel_requested:
            before = snapshot()
            call()
            assert snapshot() == before
            return
        call()
        job.cancel_requested = True
        if job.state == JobState.QUEUED:
            job.state = JobState.CANCELLED
            self._settled(job)

    @precondition(lambda self: self.attempts)
    @rule(to=st.tuples(TARGET, PUBLISH_KEYS, RECORD_STATES))
    def publish_record(self, to):
        """An attempt records a publish `started` (before its command) or `done` (after), as the
        executor does, through its own token: live, finished or long stale, or a wrong one."""
        (which, pick, wrong_token), key, state = to
        a = self._choose(which, pick)
        value = {"output": f"attempt {a.id}"} if state == RecordState.DONE else {}
        call = lambda: services.job_record(  # noqa: E731
            attempt_id=a.id, token=WRONG_TOKEN if wrong_token else a.token, key=key, state=state, value=value
        )
        if wrong_token or not self._live(a):
            self._expect_unchanged(call, REFUSED)  # a stale attempt records nothing
            return
        old = self.records.get((a.job_id, key))
        answer = call()
        if old is None:
            new = MRecord(state, value, a.number, a.number if state == RecordState.STARTED else None)
            expected = (new.state, new.value, new.attempt_number, new.started_by, False)
        elif old.state == RecordState.DONE:  # final: nothing changes, the answer is the record
            new = old
            expected = (old.state, old.value, old.attempt_number, old.started_by, True)
        elif state == RecordState.STARTED:  # the first starter stays: the answer says who started it first
            new = MRecord(state, value, a.number, old.started_by)
            expected = (state, value, a.number, old.started_by, False)
            assert answer.started_earlier == (old.started_by != a.number)
        else:
            new = MRecord(state, value, a.number, old.started_by)
            expected = (state, value, a.number, old.started_by, False)
        assert (answer.key, answer.state, answer.value, answer.attempt_number, answer.started_by, answer.already_done) == (
            key, *expected
        )
        self.records[(a.job_id, key)] = new

    # ------------------------------------------------------------------ invariants

    @invariant()
    def database_agrees_with_the_guarantees(self):
        # Four queries per step, then every check in Python.
        jobs = {row[0]: row for row in Job.objects.values_list("id", "state", "current_attempt_id", *DIMENSIONS, "key")}
        attempts = list(Attempt.objects.values_list("id", "job_id", "worker_id", "state", "lease_expires_at"))
        pins = {int(key.removeprefix("task:")): w for key, w in Affinity.objects.values_list("key", "worker_id")}
        records = {
            (job_id, key): MRecord(state, value, number, started_by)
            for job_id, key, state, value, number, started_by in JobRecord.objects.values_list(
                "job_id", "key", "state", "value", "attempt_number", "started_by"
            )
        }
        keys = {job_id: row[-1] for job_id, row in jobs.items()}
        jobs = {job_id: row[:-1] for job_id, row in jobs.items()}
        self._no_job_lost(jobs, attempts, pins)
        self._at_most_one_active_attempt_per_job(jobs, attempts)
        self._limits_and_capacity_hold(jobs, attempts)
        self._states_move_only_along_edges_and_terminal_never_changes(jobs)
        self._the_journal_is_what_live_attempts_wrote_and_done_is_final(records)
        self._each_hook_once_per_outcome_and_no_job_succeeds_twice(jobs, keys, attempts)

    def _the_journal_is_what_live_attempts_wrote_and_done_is_final(self, records):
        assert records == self.records  # a stale or wrong token wrote nothing (and every live write is there)
        for where, record in records.items():
            if record.state == RecordState.DONE:
                done = (record.value, record.attempt_number)
                assert self.seen_done.setdefault(where, done) == done, f"done record {where} changed"
        assert set(self.seen_done) <= set(records)

    def _each_hook_once_per_outcome_and_no_job_succeeds_twice(self, jobs, keys, attempts):
        by_key = {key: job_id for job_id, key in keys.items()}
        for job in self.jobs.values():
            if not job.hooks:
                continue
            hooks = {key for key in by_key if key.startswith(f"{job.key}:hook:")}
            state = jobs[job.id][1]
            assert hooks == ({f"{job.key}:hook:{state}"} if state in TERMINAL_JOB_STATES else set()), (job.id, state, hooks)
        succeeded = Counter(a[1] for a in attempts if a[3] == AttemptState.SUCCEEDED)
        assert all(n == 1 for n in succeeded.values()), succeeded

    def _no_job_lost(self, jobs, attempts, pins):
        states = {job_id: row[1] for job_id, row in jobs.items()}
        assert states == {j.id: j.state for j in self.jobs.values()}
        assert Counter(states.values()) == Counter(j.state for j in self.jobs.values())
        assert {a[0]: a[3] for a in attempts} == {a.id: a.state for a in self.attempts}
        assert pins == self.pins

    def _at_most_one_active_attempt_per_job(self, jobs, attempts):
        active = {a[0]: a for a in attempts if a[3] == AttemptState.ACTIVE}
        per_job = Counter(a[1] for a in active.values())
        assert all(n == 1 for n in per_job.values()), per_job
        for job_id, (_, state, current, *_keys) in jobs.items():
            if state == JobState.LEASED:
                assert per_job[job_id] == 1 and current in active, f"leased job {job_id} without its active attempt"
            else:
                assert per_job[job_id] == 0, f"{state} job {job_id} has an active attempt"

    def _limits_and_capacity_hold(self, jobs, attempts):
        per_key, per_worker = Counter(), Counter()
        for _, job_id, worker_id, state, lease_expires_at in attempts:
            if state == AttemptState.ACTIVE and lease_expires_at > self.now:  # live
                per_worker[worker_id] += 1
                per_key.update(zip(DIMENSIONS, jobs[job_id][3:], strict=True))
        for (d, k), n in per_key.items():
            limit = LIMITS.limit(d, k)
            assert limit == 0 or n <= limit, f"{n} live attempts on {d}={k}, limit {limit}"
        for worker_id, n in per_worker.items():
            assert n <= WORKERS[worker_id]["capacity"], f"{worker_id} holds {n} live attempts"

    def _states_move_only_along_edges_and_terminal_never_changes(self, jobs):
        states = {job_id: row[1] for job_id, row in jobs.items()}
        for job_id, old in self.seen_states.items():
            new = states[job_id]
            if old in TERMINAL_JOB_STATES:
                assert new == old, f"terminal job {job_id} moved {old} → {new}"
            elif new != old:
                assert new in JOB_TRANSITIONS[old], f"job {job_id} moved {old} → {new}"
        self.seen_states = states


@pytest.mark.django_db(transaction=True)
def test_queue_state_machine():
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            # Shrinking a failure may take Hypothesis up to five minutes; CI reports it unshrunk
            # (the failing steps are still printed) and keeps within its time budget.
            phases=[p for p in Phase if not (os.environ.get("CI") and p is Phase.shrink)],
        ),
    )

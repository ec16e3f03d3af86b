"""Child-process side of the queue benchmark.

Django reads its settings once per process, so every measurement runs in a
fresh process whose environment already names its database (`APIARY_DB_PATH`
for SQLite, `DATABASE_URL` for PostgreSQL). Run as
`python -m bench.measure KIND JSON`; the result is one `RESULT {json}` line on
stdout, everything else goes to stderr.

Kinds:
  throughput  fresh DB: migrate, pre-create tasks, enqueue N jobs through
              services.job_enqueue (timed), then start P claimer processes and
              time them draining the queue.
  claimer     one claiming process: register one worker, wait for GO on stdin,
              loop claim_round(max_jobs=1) -> attempt_finish(succeeded) until
              a round comes back starved (the queue is empty).
  depth       fresh DB: bulk-fill DEPTH queued jobs (one RequirementSet),
              EXPLAIN the claim's candidate query once, then time claim calls
              (each followed by an untimed finish) in batches the parent asks
              for on stdin, interleaved with the other depths.
"""

import datetime as dt
import json
import os
import sys
import threading
import time

from bench.together import run_together

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPABILITIES = ["apiary.workflow", "runner:shell"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def django_setup(*, migrate: bool) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import django

    django.setup()
    if migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)


def database_facts() -> dict:
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("PRAGMA journal_mode")
            journal = cursor.fetchone()[0]
            cursor.execute("PRAGMA synchronous")
            synchronous = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[cursor.fetchone()[0]]
            mode = connection.settings_dict["OPTIONS"].get("transaction_mode")
            return {"vendor": "sqlite", "journal_mode": journal, "synchronous": synchronous, "transaction_mode": mode}
        cursor.execute("SHOW server_version")
        version = cursor.fetchone()[0]
        cursor.execute("SHOW transaction_isolation")
        return {"vendor": "postgresql", "server_version": version, "isolation": cursor.fetchone()[0]}


def make_tasks(n: int, *, prefix: str) -> list:
    """Tasks for the jobs to come, bulk-created (setup, never timed)."""
    from workflows.models import Task

    now = dt.datetime.now(dt.UTC)
    tasks = [
        Task(source="bench", item_key=f"{prefix}-{i}.md", title=f"bench {i}", created_at=now, updated_at=now)
        for i in range(n)
    ]
    return Task.objects.bulk_create(tasks, batch_size=2000)


# --------------------------------------------------------------------------- throughput


def run_throughput(spec: dict) -> dict:
    django_setup(migrate=True)
    from django.db import connection

    from jobqueue import services
    from jobqueue.models import Attempt, Job, JobState
    from workflows.payload import payload_of

    facts = database_facts()
    jobs, procs = spec["jobs"], spec["procs"]
    tasks = make_tasks(jobs, prefix="tp")
    started, cpu = time.perf_counter(), time.process_time()
    for i, task in enumerate(tasks):
        # A workflow job as dispatch makes it: the task snapshot as payload, the workflow capabilities.
        services.job_enqueue(
            key=f"{task.pk}:1:bench", payload=payload_of(workflow="bench", instance_id=i + 1, task=task),
            agent="engineer", runner="shell", project="bench", source=task.source, capabilities=CAPABILITIES,
        )
    enqueue_s, enqueue_cpu = time.perf_counter() - started, time.process_time() - cpu
    connection.close()  # the claimers own the database from here

    threads = spec.get("threads", 1)
    specs = [["claimer", json.dumps({"worker_id": f"bench-{i}", "threads": threads})] for i in range(procs)]
    results = run_together("bench.measure", specs, cwd=REPO, what="claimer", timeout=600)
    claimed = sum(r["claimed"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    # Sanity: the lifecycle really ran, once per job.
    succeeded = Job.objects.filter(state=JobState.SUCCEEDED).count()
    attempts = Attempt.objects.count()
    if not (claimed == succeeded == attempts == jobs):
        raise RuntimeError(f"expected {jobs} jobs claimed once and succeeded: {claimed=} {succeeded=} {attempts=}")
    return {
        "db": facts,
        "jobs": jobs,
        "procs": procs,
        "threads": threads,
        "enqueue_per_s": jobs / enqueue_s,
        "enqueue_cpu_ms": enqueue_cpu / jobs * 1000,
        "claim_finish_per_s": claimed / span,
        # CPU the claimers spent per job: what the load of other processes on a shared machine does not change.
        "claim_finish_cpu_ms": sum(r["cpu"] for r in results) / claimed * 1000,
        "seconds": span,
        "per_process": [r["claimed"] for r in results],
        "unavailable_retries": sum(r["retries"] for r in results),
    }


def run_claimer(spec: dict) -> dict:
    """One worker. With `threads` T = 1: plain service calls, one job at a time. With T > 1,
    the embedded worker's pattern: capacity T, a claim loop that claims up to its free
    slots in one call, and T job threads that finish the jobs, each finish claiming the
    thread's next job (attempt_finish_and_claim); every call goes through one
    GroupCommitter, so calls made at the same moment share a commit."""
    django_setup(migrate=False)
    from django.db import connection

    from jobqueue import services
    from jobqueue.groupcommit import GroupCommitter

    threads = spec.get("threads", 1)
    worker = services.worker_register(
        worker_id=spec["worker_id"], capabilities=CAPABILITIES, pid=os.getpid(), capacity=threads
    )
    connection.close()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("no GO")
    cpu = time.process_time()
    start = time.monotonic()  # CLOCK_MONOTONIC is system-wide on Linux: comparable across processes
    if threads == 1:
        counts = _drain_serially(worker, lambda service, **kwargs: service(**kwargs))
    else:
        counts = _drain_in_threads(worker, threads, GroupCommitter().call)  # as the embedded worker's
    end = time.monotonic()
    return {**counts, "start": start, "end": end, "cpu": time.process_time() - cpu}


def _retried(counts: dict, call, service, **kwargs):
    from jobqueue.exceptions import Unavailable

    while True:
        try:
            return call(service, **kwargs)
        except Unavailable:
            counts["retries"] += 1


def _drain_serially(worker, call) -> dict:
    from jobqueue import services

    counts = {"claimed": 0, "retries": 0}
    fence = {"worker_id": worker.worker_id, "session": worker.session}
    while True:
        got = _retried(counts, call, services.claim_round, **fence, max_jobs=1)
        if got.starved:  # every job is claimed (an empty round that only met other claims' locks is not)
            break
        for c in got.claims:
            _retried(counts, call, services.attempt_finish, attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
            counts["claimed"] += 1
    return counts


def _drain_in_threads(worker, threads: int, call) -> dict:
    import queue

    from django.db import connection

    from jobqueue import services

    counts = {"claimed": 0, "retries": 0}
    slots = threading.Semaphore(threads)
    work: queue.SimpleQueue = queue.SimpleQueue()

    lock = threading.Lock()

    def job_thread() -> None:
        mine = {"claimed": 0, "retries": 0}
        try:
            while (c := work.get()) is not None:
                while c is not None:  # each finish claims the thread's next job, as the embedded worker's do
                    done = _retried(
                        mine, call, services.attempt_finish_and_claim, attempt_id=c.attempt_id, token=c.token,
                        outcome="succeeded", worker_id=worker.worker_id, session=worker.session, max_jobs=1,
                    )  # fmt: skip
                    mine["claimed"] += 1
                    c = done.claims[0] if done.claims else None
                slots.release()
        finally:
            connection.close()
            with lock:
                for name, n in mine.items():
                    counts[name] += n

    pool = [threading.Thread(target=job_thread) for _ in range(threads)]
    for t in pool:
        t.start()
    fence = {"worker_id": worker.worker_id, "session": worker.session}
    while True:
        slots.acquire()  # a free slot, then every other one that is free now
        free = 1
        while slots.acquire(blocking=False):
            free += 1
        got = _retried(counts, call, services.claim_round, **fence, max_jobs=free)
        for _ in range(free - len(got.claims)):
            slots.release()
        if got.starved:  # every job is claimed: the job threads finish what they hold
            break
        for c in got.claims:
            work.put(c)
    for _ in pool:
        work.put(None)
    for t in pool:
        t.join()
    connection.close()
    return counts


# --------------------------------------------------------------------------- depth


def fill(depth: int, *, ineligible: int = 0) -> None:
    """DEPTH queued jobs with one RequirementSet, by bulk_create: benchmark
    setup only; every measured change still goes through the services.
    INELIGIBLE more jobs, older (so first in claim order), need a runner the
    benchmark worker lacks: what a claim must not pay for (DESIGN §4)."""
    from django.db import transaction

    from jobqueue.models import Job, RequirementSet
    from workflows.payload import payload_of

    now = dt.datetime.now(dt.UTC)
    with transaction.atomic():
        keys = {"project": "bench", "source": "bench", "agent": "engineer"}
        reqs = RequirementSet.objects.create(
            pool=None,
            labels=[],
            capabilities=CAPABILITIES,
            runner="shell",
            digest=RequirementSet.digest_of(None, [], CAPABILITIES, ("bench", "bench", "engineer", "shell")),
            **keys,
        )
        other = ["apiary.workflow", "runner:codex"]
        blocked = RequirementSet.objects.create(
            pool=None,
            labels=[],
            capabilities=other,
            runner="codex",
            digest=RequirementSet.digest_of(None, [], other, ("bench", "bench", "engineer", "codex")),
            **keys,
        )
        total = ineligible + depth
        tasks = make_tasks(total, prefix="depth")
        # Spread available_at over the past so the order index has real work to do.
        Job.objects.bulk_create(
            [
                Job(
                    key=f"{t.pk}:1:bench",
                    payload=payload_of(workflow="bench", instance_id=i + 1, task=t),
                    project="bench",
                    source="bench",
                    agent="engineer",
                    runner="codex" if i < ineligible else "shell",
                    requirements=blocked if i < ineligible else reqs,
                    available_at=now - dt.timedelta(seconds=total - i),
                    created_at=now,
                )
                for i, t in enumerate(tasks)
            ],
            batch_size=2000,
        )


def claim_spying(worker) -> tuple[object, tuple[str, list]]:
    """One real claim, recording the candidate statement exactly as jobs_claim sends it."""
    from django.db import connection

    from jobqueue import services

    seen: list[tuple[str, list]] = []

    def spy(execute, statement, params, many, context):
        if is_candidate_query(statement):
            seen.append((statement, list(params or [])))
        return execute(statement, params, many, context)

    with connection.execute_wrapper(spy):
        (c,) = services.jobs_claim(worker_id=worker.worker_id, session=worker.session, max_jobs=1)
    if not seen:
        raise RuntimeError("jobs_claim ran no candidate query")
    return c, seen[0]


def explain(statement: str, params: list) -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + statement, params)
            return [row[-1] for row in cursor.fetchall()]
        cursor.execute("EXPLAIN " + statement, params)
        return [row[0] for row in cursor.fetchall()]


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def is_candidate_query(statement: str) -> bool:
    return "FROM queue_job j" in statement and "ORDER BY j.priority DESC" in statement


def run_depth(spec: dict) -> dict:
    """Fill, print READY, then serve `CLAIM n` lines (n timed lifecycles each,
    answered `DONE`) until `END`. The parent interleaves batches across the
    depths, so a burst of disk load from other processes on this shared
    machine lands on every depth alike instead of skewing one of them."""
    django_setup(migrate=True)
    from django.db import connection

    from jobqueue import services

    facts = database_facts()
    depth, claims, warmup = spec["depth"], spec["claims"], spec["warmup"]
    ineligible = spec.get("ineligible", 0)
    started = time.perf_counter()
    # Depth never drops below DEPTH while measuring: each measured claim takes one job for good.
    fill(depth + claims + warmup + 1, ineligible=ineligible)
    fill_s = time.perf_counter() - started
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:  # what autovacuum would soon do after a bulk load
            cursor.execute("ANALYZE")
    worker = services.worker_register(worker_id="bench-depth", capabilities=CAPABILITIES)
    first, (statement, params) = claim_spying(worker)
    services.attempt_finish(attempt_id=first.attempt_id, token=first.token, outcome="succeeded")
    plan = explain(statement, params)

    query_ms: list[float] = []

    def timed_query(execute, sql_text, sql_params, many, context):
        if not is_candidate_query(sql_text):
            return execute(sql_text, sql_params, many, context)
        t0 = time.perf_counter()
        try:
            return execute(sql_text, sql_params, many, context)
        finally:
            query_ms.append((time.perf_counter() - t0) * 1000)

    def lifecycle() -> float:
        t0 = time.perf_counter()
        (c,) = services.jobs_claim(worker_id=worker.worker_id, session=worker.session, max_jobs=1)
        elapsed = time.perf_counter() - t0
        services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
        return elapsed * 1000

    for _ in range(warmup):
        lifecycle()
    samples: list[float] = []
    print("READY", flush=True)
    with connection.execute_wrapper(timed_query):
        for line in sys.stdin:
            command = line.split()
            if command[0] == "END":
                break
            samples += [lifecycle() for _ in range(int(command[1]))]
            print("DONE", flush=True)
    if len(samples) > claims:
        raise RuntimeError(f"asked for {len(samples)} claims, filled for {claims}")
    return {
        "db": facts,
        "depth": depth,
        "ineligible": ineligible,
        "claims": len(samples),
        "fill_seconds": fill_s,
        "p50_ms": percentile(samples, 50),
        "p99_ms": percentile(samples, 99),
        "mean_ms": sum(samples) / len(samples),
        "query_p50_ms": percentile(query_ms, 50),
        "plan": plan,
        "uses_claim_index": any("job_claim_order" in line for line in plan),
        "statement": statement,
    }


KINDS = {"throughput": run_throughput, "claimer": run_claimer, "depth": run_depth}

if __name__ == "__main__":
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    emit(KINDS[kind](spec))

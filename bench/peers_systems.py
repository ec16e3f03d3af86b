"""Child-process side of bench/peers.py: the peers' enqueue and their real consumers.

    python -m bench.peers_systems KIND JSON

Like bench/measure.py's `throughput`, a driver kind enqueues N no-op jobs with
one call each (timed, in its own process), lets go of the store, then starts P
worker processes of the peer's own consumer. Each worker sets up (imports,
connection) and prints READY; once all are ready the driver sends GO to all,
and each worker times from GO to the end of its consumer's drain. The result
is one `RESULT {json}` line on stdout; everything else goes to stderr.

Drivers and their workers:
  huey           SqliteHuey (its defaults); worker: huey's Consumer, 1 worker thread
  dtdb           django-tasks-db on the database of a settings module peers.py wrote;
                 worker: the `db_worker --batch` management command
  procrastinate  PsycopgConnector; worker: App.run_worker_async(wait=False)

The peer packages are imported inside the functions: bench/peers.py imports
this module for `write_dtdb_project` in an interpreter that may lack them.
"""

import asyncio
import importlib
import io
import json
import os
import sys
import threading
import time

from bench.together import run_together

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTDB_SETTINGS = "peers_dtdb_settings"
DTDB_TASKS = "peers_dtdb_tasks"
DRAIN_TIMEOUT = 600


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the GO protocol


def drain(kind: str, spec: dict, procs: int) -> list[dict]:
    """Start `procs` workers of `kind`, wait until all have set up, send GO to
    all, and return their RESULTs."""
    specs = [[kind, json.dumps(spec | {"index": i})] for i in range(procs)]
    return run_together("bench.peers_systems", specs, cwd=REPO, what=f"{kind} worker", timeout=DRAIN_TIMEOUT)


def ready_then_go() -> tuple[float, float]:
    """READY, wait for GO; the start of this worker's clock (monotonic: system-wide) and CPU."""
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("no GO")
    return time.monotonic(), time.process_time()


def summary(jobs: int, procs: int, enqueue_s: float, enqueue_cpu: float, workers: list[dict], settings: str) -> dict:
    done = sum(w["ran"] for w in workers)
    span = max(w["end"] for w in workers) - min(w["start"] for w in workers)
    return {
        "jobs": jobs,
        "procs": procs,
        "enqueue_per_s": jobs / enqueue_s,
        "enqueue_cpu_ms": enqueue_cpu / jobs * 1000,
        "process_per_s": done / span,
        "process_cpu_ms": sum(w["cpu"] for w in workers) / done * 1000,
        "seconds": span,
        "per_process": [w["ran"] for w in workers],
        "settings": settings,
    }


def timed(enqueue, jobs: int) -> tuple[list, float, float]:
    """`enqueue()` called `jobs` times, one job each; its results, wall and CPU seconds."""
    started, cpu = time.perf_counter(), time.process_time()
    handles = [enqueue() for _ in range(jobs)]
    return handles, time.perf_counter() - started, time.process_time() - cpu


def sqlite_facts(cursor) -> str:
    cursor.execute("PRAGMA journal_mode")
    journal = cursor.fetchone()[0]
    cursor.execute("PRAGMA synchronous")
    synchronous = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[cursor.fetchone()[0]]
    return f"journal_mode={journal}, synchronous={synchronous}"


def postgres_facts(cursor) -> str:
    cursor.execute("SHOW synchronous_commit")
    commit = cursor.fetchone()[0]
    cursor.execute("SHOW transaction_isolation")
    return f"synchronous_commit={commit}, {cursor.fetchone()[0]}"


# --------------------------------------------------------------------------- huey


def make_huey(path: str):
    from huey import SqliteHuey

    # SqliteHuey's defaults: WAL, fsync=None (SQLite's own synchronous setting), results on.
    huey = SqliteHuey("bench", filename=path)

    @huey.task(name="noop")  # named: the driver and the consumer import this as different modules
    def noop():
        return None

    return huey, noop


def run_huey(spec: dict) -> dict:
    huey, noop = make_huey(spec["path"])
    settings = sqlite_facts(huey.storage.conn.cursor())  # also opens the connection before the clock
    results, enqueue_s, enqueue_cpu = timed(noop, spec["jobs"])
    huey.storage.close()
    workers = drain("huey-worker", {"path": spec["path"], "jobs": spec["jobs"]}, 1)
    ran = [i for w in workers for i in w["ids"]]
    # Sanity: every enqueued task ran once and nothing is left queued or scheduled.
    if sorted(ran) != sorted(r.id for r in results) or huey.pending_count() or huey.scheduled_count():
        raise RuntimeError(
            f"huey: {len(ran)} runs ({len(set(ran))} distinct) of {len(results)} tasks,"
            f" {huey.pending_count()} pending, {huey.scheduled_count()} scheduled"
        )
    return summary(spec["jobs"], 1, enqueue_s, enqueue_cpu, workers, f"{settings}; Consumer: 1 worker thread")


def run_huey_worker(spec: dict) -> dict:
    from huey.consumer import Consumer
    from huey.signals import SIGNAL_COMPLETE

    huey, _ = make_huey(spec["path"])
    ran: list[str] = []
    finished = threading.Event()
    end = [0.0]

    # The consumer never stops by itself: its last completion ends the clock.
    @huey.signal(SIGNAL_COMPLETE)
    def completed(signal, task, *args, **kwargs):
        ran.append(task.id)
        if len(ran) == spec["jobs"]:
            end[0] = time.monotonic()
            finished.set()

    consumer = Consumer(huey, workers=1, worker_type="thread")
    huey.storage.conn  # noqa: B018  connect before the clock
    start, cpu = ready_then_go()
    consumer.start()
    if not finished.wait(DRAIN_TIMEOUT):
        raise RuntimeError(f"huey consumer ran {len(ran)} of {spec['jobs']} tasks in {DRAIN_TIMEOUT} s")
    cpu = time.process_time() - cpu
    consumer.stop(graceful=True)
    return {"ran": len(ran), "ids": ran, "start": start, "end": end[0], "cpu": cpu}


# --------------------------------------------------------------------------- django-tasks-db


def write_dtdb_project(directory: str, database: dict) -> dict[str, str]:
    """A minimal Django project for django-tasks-db in `directory`; the env
    that selects it. Django 5.2: django-tasks is the backport of Django 6's
    django.tasks that django-tasks-db[compat] runs on."""
    os.makedirs(directory, exist_ok=True)
    settings = f"""\
SECRET_KEY = "peers-bench"
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "django_tasks_db"]
DATABASES = {{"default": {database!r}}}
TASKS = {{"default": {{"BACKEND": "django_tasks_db.DatabaseBackend"}}}}
"""
    tasks = """\
from django_tasks import task


@task()
def noop():
    return None
"""
    for name, text in ((DTDB_SETTINGS, settings), (DTDB_TASKS, tasks)):
        with open(os.path.join(directory, f"{name}.py"), "w") as fh:
            fh.write(text)
    return {"DJANGO_SETTINGS_MODULE": DTDB_SETTINGS, "PYTHONPATH": directory}


def dtdb_setup() -> str:
    import django
    from django.db import connection

    django.setup()
    with connection.cursor() as cursor:  # the persistent connection, opened before any clock
        if connection.vendor == "sqlite":
            return sqlite_facts(cursor)
        return postgres_facts(cursor)


def run_dtdb(spec: dict) -> dict:
    settings = dtdb_setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    noop = importlib.import_module(DTDB_TASKS).noop
    _, enqueue_s, enqueue_cpu = timed(noop.enqueue, spec["jobs"])
    connection.close()  # the workers own the database from here
    workers = drain("dtdb-worker", {}, spec["procs"])
    from django_tasks_db.models import DBTaskResult

    # Sanity: every task succeeded after exactly one claim.
    succeeded = DBTaskResult.objects.successful().count()
    total = DBTaskResult.objects.count()
    claims = [len(ids) for ids in DBTaskResult.objects.values_list("worker_ids", flat=True)]
    ran = sum(w["ran"] for w in workers)
    if not (succeeded == total == ran == spec["jobs"] and set(claims) == {1}):
        raise RuntimeError(f"django-tasks-db: {succeeded=} {total=} {ran=} claims per task {sorted(set(claims))}")
    return summary(spec["jobs"], spec["procs"], enqueue_s, enqueue_cpu, workers, settings)


def run_dtdb_worker(spec: dict) -> dict:
    dtdb_setup()
    from django.core.management import call_command
    from django_tasks_db.compat import task_finished

    ran = [0]

    def finished(sender, task_result, **kwargs):
        ran[0] += 1

    task_finished.connect(finished)
    start, cpu = ready_then_go()
    # --batch: exit once the queue is empty; no startup delay: it is a random sleep of up to 1 s.
    call_command("db_worker", batch=True, startup_delay=False, reload=False, verbosity=0, stdout=io.StringIO())
    end = time.monotonic()
    return {"ran": ran[0], "start": start, "end": end, "cpu": time.process_time() - cpu}


# --------------------------------------------------------------------------- procrastinate

PROCRASTINATE_RAN = [0]


def make_procrastinate(url: str):
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    @app.task(name="noop")  # named: the driver and the workers import this as different modules
    async def noop():
        PROCRASTINATE_RAN[0] += 1  # this process's share of the runs

    return app, noop


def run_procrastinate(spec: dict) -> dict:
    import psycopg

    app, noop = make_procrastinate(spec["url"])
    app.open()
    app.schema_manager.apply_schema()
    _, enqueue_s, enqueue_cpu = timed(noop.defer, spec["jobs"])
    app.close()
    workers = drain("procrastinate-worker", {"url": spec["url"]}, spec["procs"])
    with psycopg.connect(spec["url"]) as conn, conn.cursor() as cursor:
        settings = postgres_facts(cursor)
        cursor.execute("SELECT status::text, count(*) FROM procrastinate_jobs GROUP BY status")
        statuses = dict(cursor.fetchall())
        cursor.execute("SELECT count(*), count(DISTINCT job_id) FROM procrastinate_events WHERE type = 'started'")
        started, distinct = cursor.fetchone()
    # Sanity: every job succeeded and was started once.
    ran = sum(w["ran"] for w in workers)
    if not (statuses == {"succeeded": spec["jobs"]} and started == distinct == ran == spec["jobs"]):
        raise RuntimeError(f"procrastinate: {statuses=} {started=} {distinct=} {ran=}")
    return summary(
        spec["jobs"], spec["procs"], enqueue_s, enqueue_cpu, workers, f"{settings}; concurrency 1 per process"
    )


def run_procrastinate_worker(spec: dict) -> dict:
    app, _ = make_procrastinate(spec["url"])

    async def work() -> dict:
        async with app.open_async():
            await app.check_connection_async()
            loop = asyncio.get_running_loop()
            start, cpu = await loop.run_in_executor(None, ready_then_go)
            await app.run_worker_async(wait=False, concurrency=1)
            end = time.monotonic()
            return {"ran": PROCRASTINATE_RAN[0], "start": start, "end": end, "cpu": time.process_time() - cpu}

    return asyncio.run(work())


KINDS = {
    "huey": run_huey,
    "huey-worker": run_huey_worker,
    "dtdb": run_dtdb,
    "dtdb-worker": run_dtdb_worker,
    "procrastinate": run_procrastinate,
    "procrastinate-worker": run_procrastinate_worker,
}

if __name__ == "__main__":
    # Run from the module under its own name, not __main__: procrastinate warns about an App built in __main__.
    kinds = importlib.import_module("bench.peers_systems").KINDS
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    print("RESULT " + json.dumps(kinds[kind](spec)), flush=True)

"""Child process of tests/queue/test_multiprocess.py: enqueue, or claim and finish.

    python -m tests.queue.claimer setup --jobs N [--migrate]
    python -m tests.queue.claimer work --index I --workers W --deadline EPOCH --report PATH

The database comes from the environment as for any Apiary process
(APIARY_DB_PATH or DATABASE_URL). `work` registers W workers, prints "ready",
waits for a line on stdin (the parent releases every process at once), then
runs one thread per worker: claim → record → finish with the real services
and the system clock, until no job is left unfinished or the deadline passes.
Every exception a service call raises is written to the report, never
swallowed: the test fails on any.
"""

import argparse
import json
import os
import random
import sys
import threading
import time
import traceback

from jobqueue.conf import Limits, QueueConfig

# One definition of the queue settings, installed in every child and read by the test.
# Leases far longer than the run: no attempt may expire, so every job must
# end with exactly one attempt.
CONFIG = QueueConfig(
    lease_duration=600,
    limits=Limits(defaults={"project": 3}, overrides={"agent": {"deployer": 2}, "pool": {"gpu": 1}}),
)
CAPACITY = 2  # per worker; claims ask for up to this many jobs
WORKFLOWS_PER_TASK = 4

_report_lock = threading.Lock()  # the worker threads of one process share its report


def job_mix(i: int) -> dict:
    """Limit keys of the i-th job: two projects (3 each), a limited agent on a
    third of them (2), a limited pool on a tenth (1, only pool workers take it)."""
    return {
        "project": "alpha" if i % 2 else "beta",
        "agent": "deployer" if i % 3 == 0 else "engineer",
        "pool": "gpu" if i % 10 == 7 else None,
    }


def worker_spec(index: int, k: int) -> dict:
    return {"worker_id": f"p{index}w{k}", "pool": "gpu" if k == 0 else None}


def _setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    import django

    django.setup()
    from jobqueue import conf

    conf.configure(CONFIG)


def setup(args) -> None:
    from django.core.management import call_command
    from django.db import connection

    from tests.factories import enqueue_job, make_task

    if args.migrate:
        call_command("migrate", verbosity=0)
    # Only the preparation commits lazily; the claimers run with full durability.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO off")
    task = None
    for i in range(args.jobs):
        if i % WORKFLOWS_PER_TASK == 0:
            task = make_task(source="inbox")
        enqueue_job(task, workflow=f"wf{i % WORKFLOWS_PER_TASK}", runner="shell", **job_mix(i))
    print(json.dumps({"enqueued": args.jobs}), flush=True)


class _Worker(threading.Thread):
    def __init__(self, worker, deadline: float, report: dict):
        super().__init__(name=worker.worker_id, daemon=True)
        self.worker = worker
        self.deadline = deadline
        self.report = report

    def _error(self, call: str, exc: BaseException) -> None:
        with _report_lock:
            self.report["errors"].append(
                {"worker": self.worker.worker_id, "call": call, "type": type(exc).__name__, "message": str(exc)}
            )

    def run(self) -> None:
        from django.db import connection

        try:
            self._loop()
        except BaseException as exc:  # anything escaping the loop is a failure the test must see
            self._error("thread", exc)
            self.report["errors"][-1]["traceback"] = traceback.format_exc()
        finally:
            connection.close()

    def _loop(self) -> None:
        from jobqueue import services
        from jobqueue.models import TERMINAL_JOB_STATES, Job

        claims_log, finishes_log = self.report["claims"], self.report["finishes"]
        while True:
            if time.time() > self.deadline:
                left = Job.objects.exclude(state__in=TERMINAL_JOB_STATES).count()
                self._error("deadline", TimeoutError(f"deadline passed with {left} jobs unfinished"))
                return
            try:
                claims = services.jobs_claim(
                    worker_id=self.worker.worker_id, session=self.worker.session, max_jobs=CAPACITY
                )
            except Exception as exc:
                self._error("jobs_claim", exc)
                continue
            if not claims:
                if not Job.objects.exclude(state__in=TERMINAL_JOB_STATES).exists():
                    return  # drained
                # Everything left is held or over a limit: back off a moment, as a
                # worker waiting for a wake-up would, instead of spinning on the write lock.
                with _report_lock:
                    self.report["empty_claims"] += 1
                time.sleep(random.uniform(0.001, 0.005))
                continue
            for c in claims:
                claims_log.append([c.job_id, c.attempt_id, self.worker.worker_id])
            for c in claims:
                try:
                    state = services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
                except Exception as exc:
                    self._error("attempt_finish", exc)
                    continue
                finishes_log.append([c.attempt_id, state])


def work(args) -> None:
    from django.db import connection

    from jobqueue import services

    report = {"index": args.index, "pid": os.getpid(), "vendor": connection.vendor, "isolation": None}
    report |= {"claims": [], "finishes": [], "errors": [], "empty_claims": 0}
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            report["isolation"] = cursor.fetchone()[0]
    workers = []
    for k in range(args.workers):
        spec = worker_spec(args.index, k)
        workers.append(
            services.worker_register(
                worker_id=spec["worker_id"],
                pool=spec["pool"],
                capabilities=["apiary.workflow", "runner:shell"],
                capacity=CAPACITY,
                pid=os.getpid(),
            )
        )
    connection.close()  # each thread opens its own
    print("ready", flush=True)
    sys.stdin.readline()  # released together with the other processes
    threads = [_Worker(w, args.deadline, report) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, args.deadline - time.time()) + 30)
        if t.is_alive():
            report["errors"].append(
                {"worker": t.name, "call": "join", "type": "Hang", "message": "thread still running"}
            )
    with open(args.report, "w") as out:
        json.dump(report, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.queue.claimer")
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup")
    p_setup.add_argument("--jobs", type=int, required=True)
    p_setup.add_argument("--migrate", action="store_true")
    p_work = sub.add_parser("work")
    p_work.add_argument("--index", type=int, required=True)
    p_work.add_argument("--workers", type=int, required=True)
    p_work.add_argument("--deadline", type=float, required=True)
    p_work.add_argument("--report", required=True)
    args = parser.parse_args(argv)
    _setup_django()
    {"setup": setup, "work": work}[args.command](args)


if __name__ == "__main__":
    main()

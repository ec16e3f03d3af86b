"""Executor micro-benchmark: one job's path through `workflows.executor.Executor`, without the queue.

    .venv/bin/python bench/executor_micro.py [--jobs N] [--rounds R] [--steps S] [--history none|db]
        [--journal none|fake] [--profile]

Runs N claims of a workflow of S `run: "true"` steps one after another, as a
job thread of the worker runtime would: a journal over a fake transport (its
records read and log chunks taken in memory) with the job's log sender, which
is closed after the run as the runtime's finish does. `--history db` writes
step history through `DatabaseHistory` into a fresh SQLite database with the
production settings (a commit per statement, as the embedded worker's); the
default is a history that keeps nothing. Prints a Markdown table per round:
CPU of this process per job (every thread of it; the step processes' own CPU
is the next column), and jobs/s by the wall clock. `--profile` adds a cProfile
top 20 (cumulative) of one more round. A benchmark, not a test: it asserts
nothing about time.
"""

import argparse
import cProfile
import datetime as dt
import io
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIG = """
project: bench
agents:
  - id: sh
    runner: shell
    command: cat
workflows:
  - id: one
    agent: sh
    steps:
{steps}
"""


def django_setup(state: Path, *, migrate: bool) -> None:
    state.mkdir(mode=0o700)
    os.environ["APIARY_STATE_DIR"] = str(state)
    os.environ["APIARY_DB_PATH"] = str(state / "apiary.db")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    sys.path.insert(0, str(REPO))
    import django

    django.setup()
    if migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)


class NoHistory:
    def step_started(self, **kwargs) -> None:
        pass

    def step_finished(self, **kwargs) -> None:
        pass


class FakeTransport:
    """What a job's journal and log sender call, answered in memory."""

    def records(self, *, attempt_id, token):
        return []

    def record(self, *, attempt_id, token, key, state, value):
        from jobqueue.types import Record

        return Record(key=key, state=state, value=value, attempt_number=1, started_by=None)

    def log_append(self, *, attempt_id, token, stream, offset, text, final):
        from jobqueue.types import LogState

        return LogState(stream=stream, received=offset + len(text.encode()), dropped=0, ended=final)

    def heartbeat(self, **kwargs):
        raise AssertionError("no heartbeat in this benchmark")

    def close(self) -> None:
        pass


def instances(count: int) -> list[int]:
    """`count` workflow instances (no job) for DatabaseHistory's rows to belong to."""
    from workflows.models import Task, WorkflowInstance

    now = dt.datetime.now(dt.UTC)
    task = Task.objects.create(source="bench", item_key="x", created_at=now, updated_at=now)
    rows = WorkflowInstance.objects.bulk_create(
        WorkflowInstance(task=task, generation=g, workflow="one", created_at=now) for g in range(1, count + 1)
    )
    return [row.pk for row in rows]


def make_claim(n: int, instance_id: int):
    from jobqueue.types import Claim

    return Claim(
        job_id=n, attempt_id=n, attempt_number=1, token="t", lease_expires_at=dt.datetime.now(dt.UTC),
        agent="sh", runner="shell",
        payload={"workflow": "one", "instance_id": instance_id, "task": {"id": n % 50 + 1, "title": f"item {n}"}},
    )  # fmt: skip


def run_jobs(executor, claims, *, journal: str) -> None:
    from workers.journal import Journal
    from workers.logstream import LogSender

    transport = FakeTransport()
    for claim in claims:
        cancel = threading.Event()
        job_journal = logs = None
        if journal == "fake":
            job_journal = Journal(transport=transport, claim=claim, cancel=cancel)
            logs = job_journal.logs = LogSender(transport=transport, claim=claim)
        outcome = executor.run(claim, cancel, grace=1.0, journal=job_journal)
        if logs is not None:
            logs.close(5.0)
        if outcome.outcome != "succeeded":
            raise SystemExit(f"job {claim.job_id}: {outcome.outcome}: {outcome.error}")


def cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--history", choices=("none", "db"), default="none")
    parser.add_argument("--journal", choices=("none", "fake"), default="fake")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="apiary-exec-bench-") as tmp:
        root = Path(tmp)
        django_setup(root / ".apiary", migrate=args.history == "db")
        from workers.pgroups import ProcessGroups
        from workflows.config import load
        from workflows.executor import Executor
        from workflows.history import DatabaseHistory

        steps = "\n".join(f'      - id: s{i}\n        run: "true"' for i in range(1, args.steps + 1))
        (root / "apiary.yaml").write_text(CONFIG.format(steps=steps))
        executor = Executor(
            config=load(root / "apiary.yaml"), worker_id="bench",
            history=DatabaseHistory() if args.history == "db" else NoHistory(),
            groups=ProcessGroups(root / ".apiary" / "run" / "bench"),
        )  # fmt: skip
        rounds = args.rounds + (1 if args.profile else 0)
        ids = instances(args.jobs * (rounds + 1)) if args.history == "db" else list(range(1, args.jobs * (rounds + 1) + 1))
        batches = [[make_claim(n, ids[n]) for n in range(r * args.jobs, (r + 1) * args.jobs)] for r in range(rounds + 1)]
        run_jobs(executor, batches.pop()[:20], journal=args.journal)  # warm-up: imports, first directories

        results = []
        for number in range(args.rounds):
            own0, children0 = cpu()
            began = time.perf_counter()
            run_jobs(executor, batches[number], journal=args.journal)
            wall = time.perf_counter() - began
            own1, children1 = cpu()
            results.append((number + 1, (own1 - own0) * 1000 / args.jobs, (children1 - children0) * 1000 / args.jobs,
                            args.jobs / wall))  # fmt: skip
            print(f"round {number + 1}: {results[-1][1]:.2f} ms CPU/job", file=sys.stderr, flush=True)

        profile_text = None
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_jobs(executor, batches[args.rounds], journal=args.journal)
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(20)
            profile_text = out.getvalue()

    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}`  ")
    print(f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.node()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()} {platform.release()}  ")  # fmt: skip
    print(f"{args.jobs} jobs per round, {args.steps} step(s) `run: \"true\"` each, history {args.history}, "
          f"journal {args.journal}\n")  # fmt: skip
    print("| round | CPU ms/job (this process) | CPU ms/job (step processes) | jobs/s |")
    print("|---|---:|---:|---:|")
    for number, own, children, rate in results:
        print(f"| {number} | {own:.2f} | {children:.2f} | {rate:.0f} |")
    print(f"| **median** | **{statistics.median(r[1] for r in results):.2f}** | "
          f"{statistics.median(r[2] for r in results):.2f} | **{statistics.median(r[3] for r in results):.0f}** |")  # fmt: skip
    if profile_text:
        print("\n```\n" + profile_text.strip() + "\n```")


if __name__ == "__main__":
    main()

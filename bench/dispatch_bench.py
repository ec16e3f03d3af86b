"""Dispatch benchmark: the first poll of a directory source with N new files, one workflow.

    .venv/bin/python bench/dispatch_bench.py [--items N] [--rounds R] [--backend sqlite|postgres|all]

Each round runs in a child process of its own (`--child`: Django reads its settings once per
process) on a fresh database: SQLite with the production settings in a temporary directory,
PostgreSQL on a throwaway cluster from tests.pgcluster when the server binaries exist. The
child writes N small Markdown files and the apiary.yaml below, then times, through the
control plane's own calls: reading the source alone (workflows.sources.poll), one whole
poll of it (ControlPlane.poll: the read, then tasks, instances and jobs, committed), and a
second poll that finds nothing new. Dispatch = poll - read. No worker runs: what is timed
is what the control plane spends per item before any job can be claimed. Prints a Markdown
table (medians, and each round); asserts nothing about time.
"""

import argparse
import datetime as dt
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = """project: bench
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: noop, agent: sh, steps: [{id: work, run: "true"}]}]
sources: [{id: inbox, type: directory, path: inbox, pattern: "*.md", workflows: [noop]}]
settings: {worker_capacity: 4, queue: {embedded_worker: false}}
"""


def run_child(items: int, directory: Path) -> dict:
    """In the child: the files, the database, the three timed calls."""
    (directory / "inbox").mkdir()
    for i in range(items):
        (directory / "inbox" / f"item-{i:05d}.md").write_text(f"# Item {i}\n\nThe body of item {i}.\n")
    (directory / "apiary.yaml").write_text(CONFIG)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    sys.path.insert(0, REPO)
    import django

    django.setup()
    from django.core.management import call_command

    from jobqueue.models import Job
    from workflows import sources
    from workflows.config import load
    from workflows.controlplane import ControlPlane

    call_command("migrate", verbosity=0)
    config = load(directory / "apiary.yaml", environ={})
    control = ControlPlane(config=config)
    sources.poll(config.sources["inbox"], cwd=directory)  # the files read once: every round reads warm
    started = time.perf_counter()
    sources.poll(config.sources["inbox"], cwd=directory)
    read_s = time.perf_counter() - started
    started, cpu = time.perf_counter(), time.process_time()
    created = control.poll("inbox")
    poll_s, poll_cpu = time.perf_counter() - started, time.process_time() - cpu
    started = time.perf_counter()
    again = control.poll("inbox")
    again_s = time.perf_counter() - started
    if not created == items == Job.objects.count() or again:
        raise RuntimeError(f"expected {items} jobs once: first poll {created}, second {again}")
    return {"read_s": read_s, "poll_s": poll_s, "poll_cpu_s": poll_cpu, "again_s": again_s}


def one_round(items: int, database: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="apiary-dispatch-") as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "APIARY_DB_PATH")} | database
        env |= {"APIARY_STATE_DIR": tmp} | ({} if database else {"APIARY_DB_PATH": os.path.join(tmp, "apiary.db")})
        command = [sys.executable, os.path.abspath(__file__), "--child", "--items", str(items), "--dir", tmp]
        # The child logs a line per job dispatched, as the daemon does (its cost is in the figures): kept off the screen.
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or "RESULT " not in done.stdout:
            raise RuntimeError(f"the dispatch child exited {done.returncode}: {done.stderr[-3000:]}")
        return json.loads(done.stdout.split("RESULT ", 1)[1])


def measure(backend: str, items: int, rounds: int) -> list[dict]:
    if backend == "sqlite":
        return [one_round(items, {}) for _ in range(rounds)]
    sys.path.insert(0, REPO)
    from tests.pgcluster import start_cluster

    cluster = start_cluster()
    try:
        return [one_round(items, {"DATABASE_URL": cluster.create_database(f"dispatch_{r}")}) for r in range(rounds)]
    finally:
        cluster.stop()


def render(results: dict[str, list[dict]], items: int) -> str:
    def cells(samples: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(samples))} ({' / '.join(fmt.format(s) for s in samples)})"

    lines = [
        "| backend | items | read, items/s | dispatch, items/s | poll (read + dispatch), items/s | poll CPU ms/item | second poll, s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, rounds in results.items():
        read = [items / r["read_s"] for r in rounds]
        dispatch = [items / (r["poll_s"] - r["read_s"]) for r in rounds]
        poll = [items / r["poll_s"] for r in rounds]
        cpu = [r["poll_cpu_s"] / items * 1000 for r in rounds]
        again = [r["again_s"] for r in rounds]
        lines.append(
            f"| {backend} | {items:,} | {cells(read, '{:,.0f}')} | {cells(dispatch, '{:,.0f}')} | {cells(poll, '{:,.0f}')}"
            f" | {cells(cpu, '{:.3f}')} | {cells(again, '{:.2f}')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="sqlite")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(args.items, Path(args.dir))), flush=True)
        return 0
    backends = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]
    results = {backend: measure(backend, args.items, args.rounds) for backend in backends}
    print(f"`{' '.join([os.path.relpath(sys.executable, REPO), *sys.argv])}`")
    print(
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs, Python {platform.python_version()},"
        f" SQLite {sqlite3.sqlite_version}; medians of {args.rounds} rounds (each round in parentheses)"
    )
    print()
    print(render(results, args.items))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end local-mode benchmark: source items → finished jobs through `apiary run --until-idle`.

    .venv/bin/python bench/e2e.py [--items 1000,10000] [--repeat 3] [--capacity 4]
        [--source-tree DIR] [--timeout 3600] [--json PATH] [--keep]

Prints a Markdown table on stdout (progress on stderr); asserts nothing about time.

For each size N of `--items`, `--repeat` times: a temporary project with N
Markdown files in inbox/, one directory source, one shell agent and one
workflow whose only step runs `true`, the embedded worker with capacity
`--capacity` and every other setting at its default. Then the real CLI,
`apiary run --config <dir>/apiary.yaml --until-idle`, as a child process in
its own session, from this checkout or from `--source-tree DIR` (its code
first on PYTHONPATH, as bench/fleet.py does), until it exits by itself. The
tree's packages are byte-compiled first (compile_tree), as an installed Apiary's are.

Columns (bench/README.md, "End to end, local mode", says more):

* `wall s`: spawn of the child → its exit (everything: Django start-up,
  migrations, polling, dispatch, processing, the idle check and the drain).
* `dispatch items/s`: N / (last job's created_at − first task's created_at).
* `processing jobs/s`: N / (last job's finished_at − first attempt's claimed_at).
* `CPU ms/job (all)`: user+sys of the child and every descendant it reaped
  (the `true` steps included), from os.wait4, over N.
* `CPU ms/job (apiary process)`: user+sys of the apiary process alone (its
  threads, not its children), from /proc/<pid>/stat of the exited child read
  before it is reaped (waitid WNOWAIT), over N.
* `waits/job`: voluntary context switches (ru_nvcsw from os.wait4) of the child
  and its reaped descendants, over N: each is a thread that blocked — on another
  thread (a hand-off), a lock, an fsync, its step process. A count, not a time,
  but not a fixed one: a thread that finds its work already waiting does not
  block, so it varies with how the threads interleave (65–94 for the same code
  within half an hour on one machine).
* `peak RSS MB`: ru_maxrss from os.wait4 of the direct child: the largest of
  the apiary process and its reaped descendants (the steps are a few MB).

Every run's project is removed only when all runs are over (`--keep`: never), so
that no run pays for the one before: on a file system without a journal (this
machine's root: ext4 without one) the kernel skips inodes freed in the last
5 seconds when it makes a new one, and those freed in the last 5 minutes while
their inode table block is dirty (which new inodes beside them make it), and
each job makes four (its workspace, its log directory, the task file, the
step's log); bench/inode_cost.py measures what that costs. For the same reason,
leave five minutes between two invocations (the one before removed its projects
as it ended), or run every invocation of a comparison with `--keep` and delete
the projects after the last.

Before the numbers count, the database (.apiary/apiary.db, opened read-only
after the run) must hold exactly N tasks, N workflow instances, N jobs all
succeeded and N attempts all succeeded, and the child must exit 0; otherwise
the run is reported as an error and the script exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROGRESS_EVERY = 15.0  # seconds between progress lines on stderr

CONFIG = """\
project: bench
agents:
  - id: sh
    runner: shell
    command: cat
workflows:
  - id: noop
    agent: sh
    steps: [{id: work, run: "true"}]
sources:
  - {id: inbox, type: directory, path: inbox, pattern: "*.md", workflows: [noop]}
settings:
  worker_capacity: %d
  queue:
    embedded_worker: true
"""

COLUMNS = ["wall_s", "dispatch_per_s", "processing_per_s", "cpu_ms_all", "cpu_ms_apiary", "waits_per_job", "peak_rss_mb"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_project(items: int, capacity: int) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"apiary-e2e-{items}-"))
    (root / "apiary.yaml").write_text(CONFIG % capacity)
    inbox = root / "inbox"
    inbox.mkdir()
    width = len(str(items))
    for i in range(1, items + 1):
        (inbox / f"item-{i:0{width}d}.md").write_text(f"# item {i}\n\nbench item {i}\n")
    return root


def child_env(source_tree: str) -> dict[str, str]:
    """Our environment without APIARY_*/DJANGO_*/DATABASE_URL (as fleet.py), running the code of `source_tree`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"}
    env["PYTHONPATH"] = source_tree
    return env


def apiary(*words: str) -> list[str]:
    # The console script's entry point (pyproject [project.scripts]) under this interpreter;
    # -P: the working directory must not shadow the packages of --source-tree.
    return [sys.executable, "-P", "-c", "from apiary_site.cli import main; main()", *words]


def own_cpu_of_zombie(pid: int) -> float:
    """utime+stime of an exited, not yet reaped process: its own threads, without its children."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def finished_jobs(log_path: Path) -> int:
    """Progress only: the embedded worker's `finish:` lines so far (0 if the code logs them otherwise)."""
    with contextlib.suppress(OSError), open(log_path, "rb") as f:
        return f.read().count(b"apiary.worker finish: ")
    return 0


def run_apiary(root: Path, source_tree: str, timeout: float) -> dict:
    """Run `apiary run --until-idle` on `root` to its exit; its wall time, exit code and rusage."""
    log_path = root / "apiary.log"
    with open(log_path, "wb") as out:
        started_epoch, started = time.time(), time.perf_counter()
        proc = subprocess.Popen(
            apiary("run", "--config", str(root / "apiary.yaml"), "--until-idle"),
            cwd=root, env=child_env(source_tree), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,  # so Ctrl-C or a timeout can stop its whole group
        )
    exited = threading.Event()

    def wait_exit() -> None:
        # WNOWAIT leaves it a zombie, so its own CPU can still be read before wait4 reaps it.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        exited.set()

    waiter = threading.Thread(target=wait_exit, daemon=True)
    waiter.start()
    try:
        while not exited.wait(PROGRESS_EVERY):
            elapsed = time.perf_counter() - started
            log(f"    {elapsed:5.0f} s: {finished_jobs(log_path)} jobs finished")
            if timeout and elapsed > timeout:
                raise TimeoutError(f"apiary run still running after {timeout:g} s")
        wall = time.perf_counter() - started
        own_cpu = own_cpu_of_zombie(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            waiter.join()  # its waitid must see the exit before proc.wait() reaps it
            proc.wait()
    return {
        "started_epoch": started_epoch,
        "wall_s": wall,
        "exit_code": proc.returncode,
        "cpu_s_all": usage.ru_utime + usage.ru_stime,
        "cpu_s_apiary": own_cpu,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "waits": usage.ru_nvcsw,
    }


def epoch(value: str | None) -> float | None:
    """A Django SQLite datetime (naive UTC text) as a Unix time."""
    if value is None:
        return None
    moment = dt.datetime.fromisoformat(value)
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()


def read_database(root: Path) -> dict:
    db = sqlite3.connect(f"file:{root / '.apiary' / 'apiary.db'}?mode=ro", uri=True)
    try:
        def one(sql: str) -> tuple:
            return db.execute(sql).fetchone()

        tasks, first_task = one("SELECT count(*), min(created_at) FROM workflows_task")
        jobs, succeeded, last_created, last_finished = one(
            "SELECT count(*), sum(state = 'succeeded'), max(created_at), max(finished_at) FROM queue_job"
        )
        attempts, attempts_ok, first_claim = one(
            "SELECT count(*), sum(state = 'succeeded'), min(claimed_at) FROM queue_attempt"
        )
        (instances,) = one("SELECT count(*) FROM workflows_workflowinstance")
    finally:
        db.close()
    return {
        "tasks": tasks, "instances": instances, "jobs": jobs, "jobs_succeeded": succeeded or 0,
        "attempts": attempts, "attempts_succeeded": attempts_ok or 0,
        "first_task_created": epoch(first_task), "last_job_created": epoch(last_created),
        "first_claimed": epoch(first_claim), "last_job_finished": epoch(last_finished),
    }


def problems_of(items: int, run: dict, db: dict) -> list[str]:
    found = [] if run["exit_code"] == 0 else [f"apiary run exited {run['exit_code']}"]
    if "error" in db:
        return [*found, f"cannot read the database: {db['error']}"]
    for key in ("tasks", "instances", "jobs", "jobs_succeeded", "attempts", "attempts_succeeded"):
        if db[key] != items:
            found.append(f"{db[key]} {key.replace('_', ' ')}, expected {items}")
    return found


def one_run(items: int, number: int, args, made: list[Path]) -> dict:
    root = make_project(items, args.capacity)
    made.append(root)  # removed when every run is over (main): see the module's docstring
    log(f"{items} items, run {number}/{args.repeat}: {root}")
    run = run_apiary(root, args.source_tree, args.timeout)
    try:
        db = read_database(root)
    except sqlite3.Error as exc:  # e.g. the run failed before creating it: reported, not raised
        db = {"error": str(exc)}
    result = {"items": items, "run": number, "dir": str(root), **run, "db": db, "problems": problems_of(items, run, db)}
    if not result["problems"]:
        dispatch_s = db["last_job_created"] - db["first_task_created"]
        processing_s = db["last_job_finished"] - db["first_claimed"]
        result.update(
            dispatch_per_s=items / dispatch_s if dispatch_s > 0 else None,
            processing_per_s=items / processing_s if processing_s > 0 else None,
            cpu_ms_all=run["cpu_s_all"] / items * 1000,
            cpu_ms_apiary=run["cpu_s_apiary"] / items * 1000,
            waits_per_job=run["waits"] / items,
            # Where the rest of the wall time went (JSON only): before the first task, after the last finish.
            startup_s=db["first_task_created"] - run["started_epoch"],
            dispatch_s=dispatch_s,
            processing_s=processing_s,
            tail_s=run["started_epoch"] + run["wall_s"] - db["last_job_finished"],
        )
    log(f"    wall {run['wall_s']:.1f} s, exit {run['exit_code']}"
        + (f"; ERROR: {'; '.join(result['problems'])}" if result["problems"] else ""))
    return result


def medians(runs: list[dict]) -> dict:
    good = [r for r in runs if not r["problems"]]
    return {
        key: statistics.median(values) if (values := [r[key] for r in good if r.get(key) is not None]) else None
        for key in COLUMNS
    }


def row(items: int, label: str, values: dict) -> str:
    def cell(key: str, fmt: str) -> str:
        return "–" if values.get(key) is None else f"{values[key]:{fmt}}"

    cells = [f"{items:,}", label, cell("wall_s", ".1f"), cell("dispatch_per_s", ".0f"),
             cell("processing_per_s", ".1f"), cell("cpu_ms_all", ".1f"), cell("cpu_ms_apiary", ".1f"),
             cell("waits_per_job", ".0f"), cell("peak_rss_mb", ".0f")]
    return "| " + " | ".join(cells) + " |"


PACKAGES = ("apiary_site", "jobqueue", "workers", "workflows")


def compile_tree(tree: str) -> None:
    """Byte-compile the tree's packages once, as an installed Apiary is (pip compiles what it
    installs; a checkout writes __pycache__ on its first start). Without it, where
    PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every run compiles
    Apiary's own modules from source at start-up: ~0.4 s of CPU, 0.4 ms a job at 1,000 items."""
    paths = [path for package in PACKAGES if os.path.isdir(path := os.path.join(tree, package))]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *paths], check=True, stdout=subprocess.DEVNULL)


def describe_tree(tree: str) -> str:
    with contextlib.suppress(Exception):
        git = ["git", "-C", tree]
        rev = subprocess.run([*git, "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return f"{tree} at {rev.stdout.strip()}" + (" (with uncommitted changes)" if dirty else "")
    return tree


def machine() -> dict:
    return {
        "nproc": len(os.sched_getaffinity(0)), "kernel": platform.release(), "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version, "hostname": platform.node(),
    }


def report(args, command: str, when: str, facts: dict, tree: str, results: dict[int, list[dict]]) -> str:
    lines = [
        f"### End to end, local mode: N files → N jobs of one `true` step, `apiary run --until-idle`,"
        f" embedded worker capacity {args.capacity}",
        "",
        f"`{command}` — {when}; {facts['nproc']} CPUs (nproc), Linux {facts['kernel']}, Python {facts['python']},"
        f" SQLite {facts['sqlite']}; code: {tree}",
        "",
        "| items | run | wall s | dispatch items/s | processing jobs/s | CPU ms/job (all) "
        "| CPU ms/job (apiary process) | waits/job | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    errors = []
    for items, runs in results.items():
        for r in runs:
            lines.append(row(items, str(r["run"]), r) if not r["problems"] else row(items, f"{r['run']} (error)", {}))
            errors += [f"{items} items, run {r['run']}: {p}" for p in r["problems"]]
        if len(runs) > 1:
            lines.append(row(items, "**median**", medians(runs)))
    lines += ["", "CPU (all): the child and every descendant it reaped, from wait4; (apiary process): its own"
              " threads only, from /proc/<pid>/stat at exit. Waits: voluntary context switches (ru_nvcsw, wait4) of the"
              " child and its reaped descendants over N: a thread that blocked (on another thread, a lock, an fsync)."
              " Peak RSS: ru_maxrss of the direct child (wait4)."]
    if errors:
        lines += ["", "**Errors:**", *[f"- {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="1000,10000", help="comma-separated sizes (default 1000,10000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size (default 3); medians over them")
    parser.add_argument("--capacity", type=int, default=4, help="settings.worker_capacity (default 4)")
    parser.add_argument("--source-tree", default=REPO, help="the checkout whose code `apiary run` runs")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed (0: never)")
    parser.add_argument("--json", metavar="PATH", help="also write the results to PATH")
    parser.add_argument("--keep", action="store_true", help="keep the temporary projects (database, apiary.log)")
    args = parser.parse_args(argv)
    args.source_tree = os.path.abspath(args.source_tree)
    if not os.path.isfile(os.path.join(args.source_tree, "apiary_site", "cli.py")):
        # Without it the child would silently import whatever apiary the interpreter has installed.
        parser.error(f"--source-tree {args.source_tree} is not an Apiary checkout (no apiary_site/cli.py)")
    try:
        sizes = [int(s) for s in args.items.split(",") if s.strip()]
    except ValueError:
        parser.error("--items takes comma-separated integers")
    if not sizes or min(sizes) < 1 or args.repeat < 1:
        parser.error("--items and --repeat must be positive")

    def interrupted(signum, frame):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, interrupted)
    command = shlex.join(["python", "bench/e2e.py", *argv])
    when = f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    facts, tree = machine(), describe_tree(args.source_tree)
    compile_tree(args.source_tree)
    results: dict[int, list[dict]] = {}
    made: list[Path] = []
    try:
        for items in sizes:
            results[items] = [one_run(items, r + 1, args, made) for r in range(args.repeat)]
    except (KeyboardInterrupt, TimeoutError) as exc:
        log(f"stopped: {str(exc) or 'interrupted'} (the run's process group was killed)")
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        for root in made if not args.keep else ():
            shutil.rmtree(root, ignore_errors=True)

    print(report(args, command, when, facts, tree, results), end="")
    if args.json:
        document = {"command": command, "date": when, "machine": facts, "source_tree": tree,
                    "capacity": args.capacity, "runs": [r for runs in results.values() for r in runs],
                    "medians": {str(items): medians(runs) for items, runs in results.items()}}
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    failed = any(r["problems"] for runs in results.values() for r in runs)
    if failed:
        log("ERROR: some runs did not turn every item into exactly one succeeded job (see the table)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

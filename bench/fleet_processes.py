"""The operator's fleet, as a benchmark: many real `apiary worker` processes
long-polling one control plane while some of them run long jobs.

    .venv/bin/python bench/fleet_processes.py [--backend sqlite|postgres] [--workers 64] [--jobs 32]
        [--step-seconds 40] [--duration 180] [--lease 30] [--heartbeat 10] [--claim-wait 10]
        [--http-workers N] [--markdown PATH] [--keep]

Starts `apiary run` (embedded worker off, the worker protocol on a free
loopback port; SQLite by default, `--backend postgres` on a throwaway cluster
from tests/pgcluster.py) with lease 30 s / heartbeat 10 s, then N real
`apiary worker` processes (capacity 1, `--claim-wait 10`), waits until all
have registered, and drops M items into a directory source whose one
workflow step is `sleep 40`. It runs until every job has ended or
`--duration` seconds after the drop, then reports in a Markdown table (on
stdout, and appended to `--markdown PATH`): jobs succeeded, attempts that
expired while their worker process was alive, worker-log lines showing an
unanswered call, self-fencing or "stale", attempts vs jobs, and wall time.
Progress goes to stderr. A benchmark, not a test: it asserts nothing.

`--http-workers N` sets APIARY_HTTP_WORKERS (the listener's process count)
for the control plane; without it the listener's default applies.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import secrets
import shlex
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import pgcluster  # noqa: E402 - after the path: bench/ runs as a script
from workers import pgroups  # noqa: E402

TERMINAL = ("succeeded", "failed", "cancelled")
SELF_FENCED = re.compile(r"stopping the runner and discarding its result: .*self-fenced")  # once per attempt
STALE = re.compile(r"stale")
UNANSWERED = re.compile(r"heartbeat of attempt \d+ failed|control plane unavailable|claim failed")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def apiary(*args: str) -> list[str]:
    # -P: a worker's folder as working directory must not shadow the project's packages.
    return [sys.executable, "-P", "-c", "from apiary_site.cli import main; main()", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def write_config(root: Path, *, port: int, token: str, args: argparse.Namespace) -> Path:
    config = {
        "project": "fleet-bench",
        "settings": {
            "concurrency": 0,
            "queue": {
                "embedded_worker": False,
                "listen": f"127.0.0.1:{port}",
                "worker_token": token,
                "lease_duration": f"{args.lease:g}s",
                "heartbeat_interval": f"{args.heartbeat:g}s",
            },
        },
        "agents": [{"id": "sleeper", "runner": "shell", "command": "cat"}],
        "workflows": [{"id": "sleep", "agent": "sleeper",
                       "steps": [{"id": "work", "run": f"sleep {args.step_seconds:g}",
                                  "timeout": f"{args.step_seconds * 4 + 60:g}s"}]}],
        "sources": [{"id": "inbox", "type": "directory", "path": "inbox", "pattern": "*.md", "poll_interval": "1s",
                     "workflows": ["sleep"]}],
    }
    path = root / "apiary.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(config)), sort_keys=False))  # no anchors: apiary refuses them
    return path


class Queue:
    """Read the control plane's database: plain sqlite3, or psycopg for PostgreSQL."""

    def __init__(self, *, db_path: Path, database_url: str | None):
        self.db_path, self.database_url = db_path, database_url

    def rows(self, statement: str) -> list[dict]:
        if self.database_url:
            import psycopg
            from psycopg.rows import dict_row

            with psycopg.connect(self.database_url, row_factory=dict_row, connect_timeout=10) as conn:
                return conn.execute(statement).fetchall()
        if not self.db_path.exists():
            return []
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=30)) as conn:
            conn.row_factory = sqlite3.Row
            return [dict(r) for r in conn.execute(statement).fetchall()]


def utc(value) -> dt.datetime | None:
    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.UTC)


class Worker:
    def __init__(self, root: Path, worker_id: str, *, url: str, token: str, config: Path, claim_wait: float):
        self.worker_id = worker_id
        self.directory = root / "hosts" / worker_id
        self.directory.mkdir(parents=True)
        own = self.directory / "apiary.yaml"
        own.write_text(config.read_text())
        self.log_path = self.directory / "worker.log"
        argv = apiary("worker", "--control-plane", url, "--id", worker_id, "--capacity", "1", "--config", str(own),
                      "--claim-wait", f"{claim_wait:g}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=self.directory, env=clean_env(APIARY_WORKER_TOKEN=token),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.exited_at: dt.datetime | None = None

    def poll(self) -> None:
        if self.exited_at is None and self.proc.poll() is not None:
            self.exited_at = dt.datetime.now(dt.UTC)

    def lines(self, pattern: re.Pattern) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if pattern.search(line)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pgid in pgroups.recorded(self.directory / ".apiary" / "run" / self.worker_id):  # the steps' groups
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def wait_until(condition, *, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(step)


def run(args: argparse.Namespace, root: Path, database_url: str | None) -> dict:
    port, token = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"
    (root / "inbox").mkdir()
    config = write_config(root, port=port, token=token, args=args)
    env = {"DATABASE_URL": database_url} if database_url else {}
    if args.http_workers:
        env["APIARY_HTTP_WORKERS"] = str(args.http_workers)
    queue = Queue(db_path=root / ".apiary" / "apiary.db", database_url=database_url)
    workers: list[Worker] = []
    with open(root / "controlplane.log", "wb") as out:
        cp = subprocess.Popen(apiary("run", "--config", str(config)), cwd=root, env=clean_env(**env),
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def serving() -> bool:
            if cp.poll() is not None:
                raise SystemExit(f"apiary run exited {cp.returncode}; see {root / 'controlplane.log'}")
            try:
                return requests.get(f"{url}/api/worker/v1/status", headers={"Authorization": f"Bearer {token}"},
                                    timeout=5).status_code == 200
            except requests.RequestException:
                return False

        wait_until(serving, timeout=120, what="the control plane to serve")
        log(f"control plane up on {url}; starting {args.workers} workers")
        started = time.monotonic()
        for i in range(1, args.workers + 1):
            workers.append(Worker(root, f"fleet-{i:03}", url=url, token=token, config=config,
                                  claim_wait=args.claim_wait))

        def registered() -> bool:
            count = queue.rows("SELECT COUNT(*) AS n FROM queue_worker")
            n = count[0]["n"] if count else 0
            dead = [w.worker_id for w in workers if w.proc.poll() is not None]
            if dead:
                raise SystemExit(f"workers exited before registering: {dead[:5]}")
            return n >= args.workers

        wait_until(registered, timeout=300, what=f"{args.workers} workers to register", step=1.0)
        log(f"{args.workers} workers registered in {time.monotonic() - started:.1f}s; dropping {args.jobs} items")

        for i in range(1, args.jobs + 1):
            temp = root / "inbox" / f".job-{i:03}.tmp"
            temp.write_text(f"# fleet job {i}\n")
            os.replace(temp, root / "inbox" / f"job-{i:03}.md")
        dropped = time.monotonic()
        deadline = dropped + args.duration
        done_after = None
        last_report = 0.0
        while time.monotonic() < deadline:
            for worker in workers:
                worker.poll()
            states = queue.rows("SELECT state, COUNT(*) AS n FROM queue_job GROUP BY state")
            counts = {r["state"]: r["n"] for r in states}
            if time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                expired = queue.rows("SELECT COUNT(*) AS n FROM queue_attempt WHERE state = 'expired'")[0]["n"]
                log(f"t+{time.monotonic() - dropped:5.0f}s jobs {counts} attempts expired {expired}")
            if sum(counts.values()) >= args.jobs and all(counts.get(s, 0) == 0 for s in ("queued", "leased")):
                done_after = time.monotonic() - dropped
                break
            time.sleep(1.0)
        for worker in workers:
            worker.poll()

        jobs = queue.rows("SELECT id, state FROM queue_job")
        attempts = queue.rows("SELECT id, job_id, worker_id, state, claimed_at, finished_at FROM queue_attempt")
        by_id = {w.worker_id: w for w in workers}

        def alive_at_expiry(attempt: dict) -> bool:
            worker = by_id.get(attempt["worker_id"])
            ended = utc(attempt["finished_at"])
            return worker is not None and (worker.exited_at is None or (ended and ended < worker.exited_at))

        expired = [a for a in attempts if a["state"] == "expired"]
        # Claim to acknowledged finish of the succeeded attempts: the step's own time plus what the
        # claim's start and the finish waited for.
        spans = sorted((utc(a["finished_at"]) - utc(a["claimed_at"])).total_seconds()
                       for a in attempts if a["state"] == "succeeded")
        return {
            "spans": spans,
            "jobs": len(jobs),
            "succeeded": sum(j["state"] == "succeeded" for j in jobs),
            "unfinished": sum(j["state"] not in TERMINAL for j in jobs),
            "attempts": len(attempts),
            "expired": len(expired),
            "expired_alive": sum(alive_at_expiry(a) for a in expired),
            "self_fenced": sum(len(w.lines(SELF_FENCED)) for w in workers),
            "stale": sum(len(w.lines(STALE)) for w in workers),
            "unanswered": sum(len(w.lines(UNANSWERED)) for w in workers),
            "workers_logging_trouble": sum(
                bool(w.lines(SELF_FENCED) or w.lines(STALE) or w.lines(UNANSWERED)) for w in workers
            ),
            "workers_exited": sum(w.exited_at is not None for w in workers),
            "done_after": done_after,
            "ran_for": time.monotonic() - dropped,
        }
    finally:
        for worker in workers:
            worker.stop()
        if cp.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cp.pid, signal.SIGKILL)  # daemon, listener and its workers; the data is throwaway
            cp.wait(timeout=30)


def table(args: argparse.Namespace, result: dict, backend_note: str) -> str:
    spans = result["spans"]
    spans = (f"{spans[0]:.1f}s min, {statistics.median(spans):.1f}s median, {spans[-1]:.1f}s max" if spans
             else "–")
    done = (f"all ended after {result['done_after']:.0f}s" if result["done_after"] is not None
            else f"{result['unfinished']} not ended after {result['ran_for']:.0f}s")
    rows = [
        ("jobs succeeded", f"{result['succeeded']} / {args.jobs}"),
        ("attempts expired while their worker process was alive", str(result["expired_alive"])),
        ("attempts expired (all)", str(result["expired"])),
        ("worker-log lines: attempt self-fenced (stopping the runner)", str(result["self_fenced"])),
        ("worker-log lines: \"stale\"", str(result["stale"])),
        ("worker-log lines: unanswered call (heartbeat failed / unavailable / claim failed)",
         str(result["unanswered"])),
        ("workers that logged any of those", f"{result['workers_logging_trouble']} / {args.workers}"),
        ("attempts / jobs", f"{result['attempts']} / {result['jobs']}"),
        (f"succeeded attempts, claim → finish (step {args.step_seconds:g}s)", spans),
        ("wall time from the drop", done),
        ("worker processes that exited", str(result["workers_exited"])),
    ]
    command = " ".join(shlex.quote(a) for a in ["bench/fleet_processes.py", *sys.argv[1:]])
    lines = [
        f"### Fleet: {args.workers} workers, {args.jobs} × `sleep {args.step_seconds:g}` ({backend_note})",
        "",
        f"`{command}` — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
        f"lease {args.lease:g}s / heartbeat {args.heartbeat:g}s, `--claim-wait {args.claim_wait:g}`, "
        f"APIARY_HTTP_WORKERS={args.http_workers or 'default'}",
        "",
        "| measure | value |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in rows),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--step-seconds", type=float, default=40.0)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds after the drop before giving up")
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--heartbeat", type=float, default=10.0)
    parser.add_argument("--claim-wait", type=float, default=10.0)
    parser.add_argument("--http-workers", type=int, default=None, help="APIARY_HTTP_WORKERS for the control plane")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs) and print its path")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="apiary-fleet-"))
    cluster = None
    try:
        database_url = None
        note = "SQLite"
        if args.backend == "postgres":
            cluster = pgcluster.start_cluster()
            database_url = cluster.create_database("apiary_fleet")
            note = f"PostgreSQL {pgcluster.server_version(cluster.bindir)}"
        result = run(args, root, database_url)
    finally:
        if cluster:
            cluster.stop()
        if args.keep:
            log(f"kept {root}")
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    text = table(args, result, note)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()

"""Claim flood: does one worker id sending claims as fast as it can slow another worker's heartbeats?

    .venv/bin/python bench/claim_flood.py [--backend sqlite|postgres] [--threads 16] [--rate 20]
        [--baseline 10] [--duration 20] [--timeout 10] [--repeat N] [--source-tree DIR]

Each run starts a control plane of its own (bench/slow_sockets.py's: `apiary
run`, embedded worker off, default claim budget; SQLite, or PostgreSQL on a
throwaway cluster from tests/pgcluster.py, one database per run), from this
checkout or from `--source-tree DIR` (its code first on PYTHONPATH, as
bench/fleet.py does). A probe worker registers and holds one attempt; it sends
attempt heartbeats one after another on one kept-alive session, at most
`--rate` per second, for `--baseline` seconds. Then `--threads` threads, in a
child process (so their client-side CPU and GIL do not delay the probe's
thread), all act as ONE other worker: one registration, one credential (the
answer's `credential`; code without per-worker credentials answers none, and
the shared token is used), each thread on its own keep-alive session sending
`POST claims {"wait": 0, "max_jobs": 1}` as soon as the previous answer came,
ignoring Retry-After, for `--duration` seconds; the probe keeps going.

It prints a Markdown table on stdout (progress on stderr): heartbeat p50/p99/max
before and during the flood, their ratios, and the claims sent, answered 200,
answered 429 and otherwise (other statuses, timeouts, errors), and claims/s.
`--repeat N` runs it N times, each on a fresh control plane, and adds the medians.
Latency is per answered heartbeat; a probe that falls behind its rate sends
the next one at once, never several. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.fleet_processes import log  # noqa: E402 - after the path
from bench.slow_sockets import CAPABILITIES, PROTOCOL, auth, hold_attempt, start_control_plane, wait_serving  # noqa: E402
from tests import pgcluster  # noqa: E402


def register(url: str, token: str, worker_id: str, pool: str) -> tuple[str, str]:
    """Enrol `worker_id` with the shared token: (its credential, or the shared token on older code; its session)."""
    answer = requests.post(url + PROTOCOL + "workers/register", headers=auth(token), timeout=30, json={
        "worker_id": worker_id, "pool": pool, "labels": [], "capabilities": CAPABILITIES, "capacity": 1,
        "version": "claim-flood", "hostname": platform.node(), "pid": os.getpid(),
    })
    answer.raise_for_status()
    return answer.json().get("credential") or token, answer.json()["session"]


class Heartbeats:
    """One thread, one kept-alive session: the held attempt's heartbeat, back to back, at most `rate` per second."""

    def __init__(self, url: str, attempt: dict, *, rate: float, timeout: float):
        self.url = url + PROTOCOL + f"attempts/{attempt['attempt_id']}/heartbeat"
        self.attempt, self.interval, self.timeout = attempt, 1.0 / rate, timeout
        self.phase = "baseline"  # the phase the next heartbeat counts in; None stops the thread
        self.results: list[tuple[str, float | None, str]] = []  # (phase, latency s or None, status or error)
        self.thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def _run(self) -> None:
        headers, body = auth(self.attempt["credential"]), {"token": self.attempt["token"]}
        tick = time.monotonic()
        with requests.Session() as session:
            while (phase := self.phase) is not None:
                started = time.monotonic()
                try:
                    answer = session.post(self.url, headers=headers, json=body, timeout=self.timeout)
                    self.results.append((phase, time.monotonic() - started, str(answer.status_code)))
                except requests.RequestException as exc:
                    self.results.append((phase, None, type(exc).__name__))
                tick = max(tick + self.interval, time.monotonic())
                time.sleep(max(0.0, tick - time.monotonic()))

    def summary(self, phase: str) -> dict:
        rows = [r for r in self.results if r[0] == phase]
        latencies = sorted(r[1] for r in rows if r[1] is not None)
        return {
            "sent": len(rows),
            "other": len(rows) - sum(r[2].startswith("2") for r in rows),
            "p50": statistics.median(latencies) * 1000 if latencies else None,
            "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] * 1000 if latencies else None,
            "max": latencies[-1] * 1000 if latencies else None,
        }


def flood(url: str, credential: str, worker_id: str, session: str, threads: int, duration: float,
          timeout: float, go, report) -> None:
    """The child process: `threads` threads claiming as one worker once `go` is set (started before the
    baseline, so its imports do not disturb it); reports "ready", "started", then the counts."""
    body = {"worker_id": worker_id, "session": session, "max_jobs": 1, "wait": 0}
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    release = threading.Barrier(threads + 1)
    deadline = 0.0

    def claimer() -> None:
        mine: collections.Counter[str] = collections.Counter()
        with requests.Session() as http:
            release.wait()
            while time.monotonic() < deadline:
                try:
                    answer = http.post(url + PROTOCOL + "claims", headers=auth(credential), json=body, timeout=timeout)
                    mine[str(answer.status_code)] += 1
                except requests.RequestException as exc:
                    mine[type(exc).__name__] += 1
        with lock:
            counts.update(mine)

    pool = [threading.Thread(target=claimer, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    report.put("ready")
    go.wait()
    started = time.monotonic()
    deadline = started + duration
    release.wait()
    report.put("started")
    for thread in pool:
        thread.join()
    report.put({"counts": dict(counts), "elapsed": time.monotonic() - started})


def one_run(args: argparse.Namespace, database_url: str | None, root: Path) -> dict:
    proc, url, token = start_control_plane(root, database_url, extra_env={"PYTHONPATH": args.source_tree})
    child, flooder = None, f"claim-flood-{os.getpid()}"
    try:
        wait_serving(url, token, proc)
        attempt = hold_attempt(url, token, "probe")
        if attempt is None:
            raise SystemExit("the probe worker claimed nothing within 30s (see controlplane.log)")
        credential, session = register(url, token, flooder, "probe")
        own = credential != token
        log(f"serving at {url}; holding attempt {attempt['attempt_id']}; flooder "
            f"{'has its own credential' if own else 'uses the shared token (no credential answered)'}")
        spawn = multiprocessing.get_context("spawn")
        go, report = spawn.Event(), spawn.Queue()
        child = spawn.Process(target=flood, daemon=True, args=(
            url, credential, flooder, session, args.threads, args.duration, args.timeout, go, report))
        child.start()
        if report.get(timeout=60) != "ready":
            raise SystemExit("the flood process did not start")
        probe = Heartbeats(url, attempt, rate=args.rate, timeout=args.timeout)
        probe.thread.start()
        time.sleep(args.baseline)
        go.set()
        if report.get(timeout=60) != "started":
            raise SystemExit("the flood process did not start")
        probe.phase = "flood"
        log(f"flooding with {args.threads} threads for {args.duration:g}s")
        result = report.get(timeout=args.duration + args.timeout + 60)
        probe.phase = None
        child.join(timeout=30)
        probe.thread.join(timeout=args.timeout + 5)
    finally:
        if child is not None and child.is_alive():
            child.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    counts, base, during = result["counts"], probe.summary("baseline"), probe.summary("flood")
    other = {k: v for k, v in counts.items() if k not in ("200", "429")}
    return {
        "baseline": base, "flood": during, "own_credential": own,
        "p50_ratio": during["p50"] / base["p50"] if during["p50"] and base["p50"] else None,
        "p99_ratio": during["p99"] / base["p99"] if during["p99"] and base["p99"] else None,
        "sent": sum(counts.values()), "200": counts.get("200", 0), "429": counts.get("429", 0),
        "other": sum(other.values()), "other_kinds": ", ".join(f"{k} {v}" for k, v in sorted(other.items())),
        "claims_per_s": sum(counts.values()) / result["elapsed"],
    }


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def medians(runs: list[dict]) -> dict:
    numbers = ("p50_ratio", "p99_ratio", "sent", "200", "429", "other", "claims_per_s")
    return {
        **{phase: {k: median(r[phase][k] for r in runs) for k in ("sent", "other", "p50", "p99", "max")}
           for phase in ("baseline", "flood")},
        **{k: median(r[k] for r in runs) for k in numbers}, "other_kinds": "",
    }


def rows(label: str, run: dict) -> list[str]:
    def num(value: float | None, fmt: str = ".1f", suffix: str = "") -> str:
        return "–" if value is None else f"{value:{fmt}}{suffix}"

    def probe(phase: str) -> list[str]:
        s = run[phase]
        return [label, phase, num(s["sent"], ".0f"), num(s["other"], ".0f"), num(s["p50"]), num(s["p99"]), num(s["max"])]

    other = num(run["other"], ".0f") + (f" ({run['other_kinds']})" if run["other_kinds"] else "")
    flood = [num(run["p50_ratio"], ".2f", "×"), num(run["p99_ratio"], ".2f", "×"), num(run["sent"], ".0f"),
             num(run["200"], ".0f"), num(run["429"], ".0f"), other, num(run["claims_per_s"], ".0f")]
    return ["| " + " | ".join(cells) + " |" for cells in (probe("baseline") + [""] * 7, probe("flood") + flood)]


def describe_tree(tree: str) -> str:
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                             check=True).stdout.strip()
        return f"{tree} at {rev}"
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--threads", type=int, default=16, help="flooding threads, all one worker id")
    parser.add_argument("--rate", type=float, default=20.0, help="heartbeats per second, at most")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds of heartbeats alone")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of flood")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-call timeout, seconds")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--source-tree", default=str(REPO), help="the checkout whose code the control plane runs")
    args = parser.parse_args()
    args.source_tree = os.path.abspath(args.source_tree)

    cluster, runs = None, []
    note = "SQLite"
    try:
        if args.backend == "postgres":
            cluster = pgcluster.start_cluster()
            note = f"PostgreSQL {pgcluster.server_version(cluster.bindir)}"
        for i in range(args.repeat):
            log(f"run {i + 1}/{args.repeat}")
            root = Path(tempfile.mkdtemp(prefix="apiary-flood-"))
            try:
                database_url = cluster.create_database(f"apiary_flood_{i}") if cluster else None
                runs.append(one_run(args, database_url, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if cluster:
            cluster.stop()

    command = shlex.join(["bench/claim_flood.py", *sys.argv[1:]])
    lines = [
        f"### Claim flood: {args.threads} threads as one worker id, `wait: 0`, {args.duration:g}s, "
        f"vs one attempt's heartbeats at ≤{args.rate:g}/s ({note})",
        "",
        f"`{command}` — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
        f"APIARY_HTTP_WORKERS={os.environ.get('APIARY_HTTP_WORKERS', 'default')}; control plane code: "
        f"{describe_tree(args.source_tree)}; flooder credential: "
        f"{'its own' if runs[0]['own_credential'] else 'the shared token (none answered)'}",
        "",
        "| run | phase | heartbeats | not 2xx or unanswered | p50 ms | p99 ms | max ms | p50 ratio | p99 ratio "
        "| claims sent | 200 | 429 | other | claims/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, run in enumerate(runs, 1):
        lines += rows(str(i), run)
    if len(runs) > 1:
        lines += rows("median", medians(runs))
    print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Apiary's queue core beside its peers, in one invocation, in alternating rounds.

    /work/venv-bench/bin/python bench/peers.py [--backend sqlite|postgres|all] [--jobs N] [--rounds R]
        [--quick] [--apiary-spec JSON] [--json PATH]

Every row enqueues N no-op jobs one call at a time (timed, in a child process
of its own, as bench/measure.py does for Apiary), then drains them with the
system's own consumer in P OS processes: each worker sets up, says READY, and
the clock runs from GO to the end of the last worker's drain (Apiary,
django-tasks-db and procrastinate stop on an empty queue; huey's consumer
never stops by itself, so its last completion signal ends the clock). Each
row runs on a fresh store every round: SQLite files in one temporary
directory, PostgreSQL databases in one throwaway cluster (tests.pgcluster).

Rows: SQLite — Apiary (1 claimer), huey (SqliteHuey, its Consumer with one
worker thread), django-tasks-db (db_worker, 1 process); PostgreSQL — Apiary
(4 claimers), procrastinate (4 worker processes, concurrency 1 each),
django-tasks-db (2 db_worker processes). The odd rounds run the rows in
reverse order, so drift on this shared machine does not favour one row.

The peers come from requirements-bench.txt, in a venv of their own (see
PIP below). Progress goes to stderr, the tables to stdout. A benchmark, not a
test: it asserts nothing about time.
"""

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script: bench/ is sys.path[0], not the repo
    sys.path.insert(0, REPO)

from bench.peers_systems import write_dtdb_project  # noqa: E402
from bench.queue_bench import child  # noqa: E402

PIP = (
    "python3 -m venv /work/venv-bench && /work/venv-bench/bin/pip install -r requirements.txt"
    " -r requirements-bench.txt, then run /work/venv-bench/bin/python bench/peers.py"
)
# backend -> (system, processes), in the order of even rounds.
ROWS = {
    "sqlite": [("Apiary", 1), ("huey", 1), ("django-tasks-db", 1)],
    "postgres": [("Apiary", 4), ("procrastinate", 4), ("django-tasks-db", 2)],
}
# The distributions each peer needs (their versions go in the header).
NEEDS = {"huey": ["huey"], "django-tasks-db": ["django-tasks-db", "django-tasks"], "procrastinate": ["procrastinate"]}
# What the measured settings do not say about a row.
NOTES = {
    "sqlite": {
        "Apiary": "apiary_site settings; bench.measure claimer (jobs_claim → attempt_finish; spec extras in the header)",
        "huey": "at-most-once (the dequeue deletes the task before it runs); SqliteHuey defaults (fsync=None)",
        "django-tasks-db": "CONN_MAX_AGE=None, init_command journal_mode=WAL; db_worker --batch --no-startup-delay",
    },
    "postgres": {
        "Apiary": "apiary_site settings; bench.measure claimers (jobs_claim → attempt_finish; spec extras in the header)",
        "procrastinate": "PsycopgConnector, async no-op task, run_worker_async(wait=False) defaults",
        "django-tasks-db": "CONN_MAX_AGE=None; db_worker --batch --no-startup-delay",
    },
}
LABELS = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(system: str) -> list[str]:
    return [d for d in NEEDS.get(system, []) if version(d) is None]


# --------------------------------------------------------------------------- stores


class Stores:
    """Fresh stores, one per row and round: a directory under one temporary
    directory (SQLite files, django-tasks-db's project) and, for PostgreSQL,
    a database in one throwaway cluster."""

    def __init__(self, cluster):
        self.root = tempfile.mkdtemp(prefix="apiary-peers-")
        self.cluster = cluster
        self._n = 0
        fs = subprocess.run(["stat", "-f", "-c", "%T", self.root], capture_output=True, text=True, check=False)
        self.where = f"stores: SQLite files under {self.root} ({fs.stdout.strip() or 'unknown'} file system), one directory per row and round"
        if cluster:
            self.where += (
                f"; PostgreSQL: one throwaway cluster (tests/pgcluster.py: fsync=on, synchronous_commit=on)"
                f" with its data under {self.cluster.directory}, a fresh database per row and round"
            )

    def fresh(self, backend: str, system: str) -> dict:
        self._n += 1
        name = f"m{self._n}_{system.replace('-', '_').lower()}"
        directory = os.path.join(self.root, name)
        os.makedirs(directory)
        store = {"dir": directory, "backend": backend}
        if backend == "postgres":
            store |= {"dbname": name, "host": self.cluster.host, "port": self.cluster.port}
            store["url"] = self.cluster.create_database(name)
        return store

    def close(self) -> None:
        if self.cluster:
            self.cluster.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def django_database(store: dict) -> dict:
    if store["backend"] == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.path.join(store["dir"], "dtdb.db"),
            "CONN_MAX_AGE": None,
            "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL;"},
        }
    from tests.pgcluster import SUPERUSER

    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": store["dbname"],
        "USER": SUPERUSER,
        "HOST": store["host"],
        "PORT": str(store["port"]),
        "CONN_MAX_AGE": None,
    }


# --------------------------------------------------------------------------- rows


def run_row(system: str, procs: int, store: dict, jobs: int, apiary_spec: dict) -> dict:
    """One row once on a fresh store: enqueue/process jobs/s and the settings it ran with."""
    if system == "Apiary":
        if store["backend"] == "sqlite":
            env = {"APIARY_DB_PATH": os.path.join(store["dir"], "apiary.db"), "APIARY_STATE_DIR": store["dir"]}
        else:
            env = {"DATABASE_URL": store["url"]}
        res = child("bench.measure", ["throughput", json.dumps({"jobs": jobs, "procs": procs} | apiary_spec)], env)
        db = res["db"]
        settings = (
            f"journal_mode={db['journal_mode']}, synchronous={db['synchronous']}, {db['transaction_mode']}"
            if db["vendor"] == "sqlite"
            else f"{db['isolation']}"
        )
        return {
            "enqueue_per_s": res["enqueue_per_s"],
            "process_per_s": res["claim_finish_per_s"],
            "process_cpu_ms": res["claim_finish_cpu_ms"],
            "per_process": res["per_process"],
            "settings": settings,
            "measure": res,
        }
    spec = {"jobs": jobs, "procs": procs}
    if system == "huey":
        return child(
            "bench.peers_systems", ["huey", json.dumps(spec | {"path": os.path.join(store["dir"], "huey.db")})], {}
        )
    if system == "procrastinate":
        return child("bench.peers_systems", ["procrastinate", json.dumps(spec | {"url": store["url"]})], {})
    env = write_dtdb_project(store["dir"], django_database(store))
    return child("bench.peers_systems", ["dtdb", json.dumps(spec)], env)


def run_rounds(plan: list[tuple[str, str, int]], rounds: int, jobs: int, apiary_spec: dict, stores: Stores) -> dict:
    """backend -> system -> one result per round (a dict with "error" when the row failed)."""
    results: dict[str, dict[str, list]] = {}
    for r in range(rounds):
        for backend, system, procs in plan if r % 2 == 0 else plan[::-1]:
            t0 = time.monotonic()
            tag = f"[round {r + 1}/{rounds}] {LABELS[backend]} {system} ({procs} proc)"
            try:
                res = run_row(system, procs, stores.fresh(backend, system), jobs, apiary_spec)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                log(f"{tag}: FAILED: {exc}")
                res = {"error": str(exc)}
            else:
                log(
                    f"{tag}: enqueue {res['enqueue_per_s']:.0f}/s, process {res['process_per_s']:.0f}/s"
                    f" ({res['process_cpu_ms']:.2f} CPU ms/job), split {res['per_process']}"
                    f" ({time.monotonic() - t0:.1f} s)"
                )
            results.setdefault(backend, {}).setdefault(system, [None] * rounds)[r] = res
    return results


# --------------------------------------------------------------------------- table


def value(res: dict | None, key: str) -> float | None:
    return res[key] if res and "error" not in res else None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratios(apiary: list, peer: list, key: str) -> list[float | None]:
    """Apiary/peer for each round: both ran in the same round, minutes apart at most."""
    out = []
    for a, p in zip(apiary, peer, strict=True):
        va, vp = value(a, key), value(p, key)
        out.append(va / vp if va is not None and vp else None)
    return out


def fmt(v: float | None, spec: str = ",.0f") -> str:
    return format(v, spec) if v is not None else "—"


def render_backend(backend: str, label: str, results: dict[str, list], skipped: dict[str, str]) -> list[str]:
    lines = [
        f"### {label}",
        "",
        "| system | backend | processes | process jobs/s per round | process median | enqueue jobs/s median"
        " | Apiary/peer process, per round | Apiary/peer process, median | Apiary/peer enqueue, median | settings |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    apiary = results.get("Apiary")
    for system, procs in ROWS[backend]:
        if system in skipped:
            lines.append(f"| {system} | {label} | {procs} | {skipped[system]} | | | | | | |")
            continue
        runs = results[system]
        per_round = " / ".join(fmt(value(r, "process_per_s")) if r and "error" not in r else "err" for r in runs)
        cells = [
            fmt(median([value(r, "process_per_s") for r in runs])),
            fmt(median([value(r, "enqueue_per_s") for r in runs])),
        ]
        if system == "Apiary" or apiary is None:
            cells += ["—", "—", "—"]
        else:
            proc_ratios = ratios(apiary, runs, "process_per_s")
            cells += [
                " / ".join(fmt(x, ".2f") for x in proc_ratios),
                fmt(median(proc_ratios), ".2f"),
                fmt(median(ratios(apiary, runs, "enqueue_per_s")), ".2f"),
            ]
        measured = next((r["settings"] for r in runs if r and "error" not in r), "")
        settings = "; ".join(s for s in (measured, NOTES[backend][system]) if s)
        lines.append(f"| {system} | {label} | {procs} | {per_round} | {' | '.join(cells)} | {settings} |")
    errors = [
        f"{s} round {i + 1}: {r['error']}"
        for s, runs in results.items()
        for i, r in enumerate(runs)
        if r and "error" in r
    ]
    return lines + ([""] + [f"error: {e}" for e in errors] if errors else [])


def git_commit() -> str:
    out = subprocess.run(
        ["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def header(jobs: int, rounds: int, apiary_spec: dict, pg_version: str | None) -> list[str]:
    peers = ["huey", "django-tasks", "django-tasks-db", "procrastinate", "psycopg"]
    versions = ", ".join(f"{d} {version(d) or 'absent'}" for d in ["Django", *peers])
    return [
        "# Apiary beside its peers",
        "",
        f"command: {shlex.join([sys.executable, *sys.argv])}",
        f"date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"machine: nproc {len(os.sched_getaffinity(0))}, {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}, SQLite {sqlite3.sqlite_version},"
        f" PostgreSQL {pg_version or 'absent'}",
        f"versions: Apiary {git_commit()}, {versions}",
        f"sizes: {jobs} no-op jobs per row and round, {rounds} round(s), odd rounds in reverse row order;"
        f" Apiary spec extras: {json.dumps(apiary_spec) if apiary_spec else 'none'}",
    ]


FOOTER = [
    "enqueue jobs/s: N single enqueues in one process, timed there (Apiary services.job_enqueue after an untimed"
    " bulk_create of its tasks; huey task call; django-tasks Task.enqueue(); procrastinate Task.defer()).",
    "process jobs/s: N / (last worker's end - first worker's start); each worker has set up (imports, connection)"
    " before GO. End: the worker's drain loop returning on an empty queue (Apiary, django-tasks-db, procrastinate),"
    " huey's last SIGNAL_COMPLETE (its consumer never stops by itself).",
    "Apiary/peer > 1: Apiary faster. Per-round ratios pair rows of the same round. Sanity checks after every row:"
    " each job ran once and ended succeeded; a failed row shows 'err' and its error below the table.",
]


def postgres_cluster(bindir) -> tuple[object | None, str | None]:
    """The throwaway cluster, or None and why not."""
    if not bindir:
        return None, "skipped: no PostgreSQL server binaries found (tests.pgcluster.find_bindir)"
    from tests.pgcluster import start_cluster

    try:
        return start_cluster(), None
    except RuntimeError as exc:
        log(f"peers.py: PostgreSQL skipped: {exc}")
        return None, f"skipped: the throwaway cluster did not start ({str(exc).splitlines()[0]})"


def absent_peers(backends: list[str]) -> dict[str, str]:
    """system -> the table's note, for every peer whose packages this interpreter lacks."""
    skipped = {}
    for system in sorted({s for b in backends for s, _ in ROWS[b]} - {"Apiary"}):
        if absent := missing(system):
            log(f"peers.py: {system} skipped: {', '.join(absent)} not installed for {sys.executable}; {PIP}")
            skipped[system] = f"skipped: {', '.join(absent)} not installed (pip install -r requirements-bench.txt)"
    return skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="all")
    parser.add_argument("--jobs", type=int, help="no-op jobs per row and round (default 2000; --quick: 300)")
    parser.add_argument("--rounds", type=int, help="rounds, each running every row once (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 300 jobs, 1 round")
    parser.add_argument("--apiary-spec", default="{}", metavar="JSON", help="extra keys for bench.measure throughput")
    parser.add_argument("--json", metavar="PATH", help="also write every per-round result to PATH")
    args = parser.parse_args(argv)
    jobs = args.jobs or (300 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 3)
    apiary_spec = json.loads(args.apiary_spec)
    if not isinstance(apiary_spec, dict):
        parser.error("--apiary-spec must be a JSON object")
    wanted = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]

    from tests.pgcluster import find_bindir, server_version

    bindir = find_bindir()
    pg_version = server_version(bindir) if bindir else None
    head = header(jobs, rounds, apiary_spec, pg_version)
    started = time.monotonic()
    skipped = absent_peers(wanted)
    notes: dict[str, str] = {}
    cluster = None
    if "postgres" in wanted:
        cluster, why_not = postgres_cluster(bindir)
        if why_not:
            notes["postgres"] = why_not
    plan = [(b, s, p) for b in wanted if b not in notes for s, p in ROWS[b] if s not in skipped]
    stores = Stores(cluster)
    try:
        results = run_rounds(plan, rounds, jobs, apiary_spec, stores)
    finally:
        stores.close()

    lines = list(head)
    labels = {"sqlite": f"SQLite {sqlite3.sqlite_version}", "postgres": f"PostgreSQL {pg_version or ''}".strip()}
    for backend in wanted:
        lines.append("")
        if backend in notes:
            lines += [f"### {labels[backend]}", "", notes[backend]]
        else:
            lines += render_backend(backend, labels[backend], results.get(backend, {}), skipped)
    lines += ["", *FOOTER, stores.where, f"wall time: {time.monotonic() - started:.0f} s"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": head, "notes": notes, "skipped": skipped, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

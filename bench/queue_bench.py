"""Queue benchmark: enqueue and claim+finish throughput, claim latency by depth.

    .venv/bin/python bench/queue_bench.py [--backend sqlite|postgres|all] [--quick] [--repeat N]

Prints a table on stdout (progress goes to stderr). Every measurement runs in
its own child process (bench/measure.py) on a fresh database: Django reads
its settings once per process, and a fresh database keeps one measurement's
leftovers out of the next. SQLite runs with the production settings (WAL,
synchronous=FULL, IMMEDIATE transactions) in a temporary directory;
PostgreSQL runs on a throwaway cluster from tests.pgcluster when the server
binaries exist. This is a benchmark, not a test: it asserts nothing about time.
"""

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = {"jobs": 2000, "bare_jobs": 3000, "depths": [1000, 10000, 100000], "claims": 300, "batch": 25, "warmup": 20}
QUICK = {"jobs": 300, "bare_jobs": 500, "depths": [1000, 10000], "claims": 100, "batch": 25, "warmup": 10}

P50_RATIO_TARGET = 1.5
SQLITE_ONE_PROCESS_TARGET = 800


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def child(module: str, args: list[str], env: dict[str, str]) -> dict:
    """Run `python -m module args…` with `env` added; its RESULT line as a dict."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "APIARY_DB_PATH")}
    full_env |= env
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=full_env, stdout=subprocess.PIPE, text=True, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{module} {args[:1]} exited {proc.returncode} without a result")


# --------------------------------------------------------------------------- backends


class SqliteBackend:
    name = "sqlite"

    def __init__(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="apiary-bench-")
        self._n = 0

    def env(self) -> dict[str, str]:
        """A fresh database file for the next measurement."""
        self._n += 1
        directory = os.path.join(self._tmp.name, f"m{self._n}")
        os.makedirs(directory)
        return {"APIARY_DB_PATH": os.path.join(directory, "apiary.db"), "APIARY_STATE_DIR": directory}

    def close(self) -> None:
        self._tmp.cleanup()


class PostgresBackend:
    name = "postgres"

    def __init__(self):
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        from tests.pgcluster import start_cluster

        self._cluster = start_cluster()
        self._n = 0

    def env(self) -> dict[str, str]:
        """A fresh database in the throwaway cluster for the next measurement."""
        self._n += 1
        return {"DATABASE_URL": self._cluster.create_database(f"apiary_bench_{self._n}")}

    def close(self) -> None:
        self._cluster.stop()


def postgres_binaries() -> str | None:
    """The `postgres` server program the throwaway cluster would use, or None."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests.pgcluster import find_bindir

    bindir = find_bindir()
    return str(bindir / "postgres") if bindir else None


def postgres_version() -> str:
    binary = postgres_binaries()
    if not binary:
        return "PostgreSQL absent"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return out.replace("postgres (PostgreSQL) ", "PostgreSQL ")


# --------------------------------------------------------------------------- measurements


def measure_backend(backend, sizes: dict, repeat: int) -> dict:
    """Every measurement `repeat` times; lists of samples per metric."""
    samples: dict[str, list] = {}

    def add(key: str, value) -> None:
        samples.setdefault(key, []).append(value)

    for r in range(repeat):
        for procs in (1, 4):
            t0 = time.monotonic()
            res = child(
                "bench.measure", ["throughput", json.dumps({"jobs": sizes["jobs"], "procs": procs, "threads": sizes.get("threads", 1)})], backend.env()
            )
            add("enqueue", res["enqueue_per_s"])
            add(f"claim_finish_{procs}", res["claim_finish_per_s"])
            add("enqueue_cpu", res["enqueue_cpu_ms"])
            add(f"claim_finish_cpu_{procs}", res["claim_finish_cpu_ms"])
            add("db", res["db"])
            log(
                f"[{backend.name} #{r + 1}] {procs} claimer(s), {res['jobs']} jobs: enqueue {res['enqueue_per_s']:.0f}/s,"
                f" claim+finish {res['claim_finish_per_s']:.0f}/s ({res['claim_finish_cpu_ms']:.2f} CPU ms/job), split {res['per_process']},"
                f" retries {res['unavailable_retries']} ({time.monotonic() - t0:.1f} s)"
            )
            if procs == 1 and backend.name == "sqlite":
                # Right after the one-process run, so both see the same disk: the machine is shared.
                res = child("bench.bare_sqlite", [json.dumps({"jobs": sizes["bare_jobs"]})], {})
                add("bare", res["claim_finish_per_s"])
                add("bare_cpu", res["cpu_ms"])
                log(
                    f"[bare sqlite3 #{r + 1}] {res['jobs']} jobs: {res['claim_finish_per_s']:.0f}/s ({res['cpu_ms']:.2f} CPU ms/job)"
                )
        for res in measure_depths(backend, sizes):
            label = "blocked" if res["ineligible"] else res["depth"]
            add(f"p50_{label}", res["p50_ms"])
            add(f"p99_{label}", res["p99_ms"])
            add(f"query_{label}", res["query_p50_ms"])
            add(f"index_{label}", res["uses_claim_index"])
            add(f"plan_{label}", res["plan"])
            what = f"{res['ineligible']} ineligible queued ahead" if res["ineligible"] else f"depth {res['depth']}"
            log(
                f"[{backend.name} #{r + 1}] {what}: claim p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms,"
                f" candidate query p50 {res['query_p50_ms']:.3f} ms (fill {res['fill_seconds']:.1f} s)"
            )
    return samples


def measure_depths(backend, sizes: dict) -> list[dict]:
    """Claim latency at every depth (and behind ineligible jobs), measured in
    interleaved batches: the fills run one at a time, then each round asks
    every depth for a batch of claims in turn. Commit latency here is mostly
    fsync, which other processes on this shared machine can slow down for
    seconds; interleaving spreads such bursts over all depths alike."""
    claims, batch = sizes["claims"], sizes["batch"]
    specs = [{"depth": d, "claims": claims, "warmup": sizes["warmup"]} for d in sizes["depths"]]
    specs.append({"depth": 0, "ineligible": sizes["depths"][-1], "claims": claims, "warmup": sizes["warmup"]})
    servers = []
    try:
        for spec in specs:  # one fill at a time: the machine has two cores
            full_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "APIARY_DB_PATH")}
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.measure", "depth", json.dumps(spec)],
                cwd=REPO,
                env=full_env | backend.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            servers.append(proc)
            expect(proc, "READY")
        for n in range(claims // batch):
            for proc in servers[n % len(servers) :] + servers[: n % len(servers)]:
                proc.stdin.write(f"CLAIM {batch}\n")
                proc.stdin.flush()
                expect(proc, "DONE")
        results = []
        for proc in servers:
            out, _ = proc.communicate("END\n", timeout=120)
            results.append(next(json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")))
        return results
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()


def expect(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline()
    if line.strip() != word:
        raise RuntimeError(f"depth child answered {line!r}, expected {word} (exit {proc.poll()})")


# --------------------------------------------------------------------------- table


def med(samples: dict, key: str) -> float | None:
    values = samples.get(key)
    return statistics.median(values) if values else None


def render(results: dict[str, dict | str], sizes: dict, repeat: int) -> str:
    backends = list(results)
    rows: list[tuple[str, list[str], str]] = []

    def cells(fn) -> list[str]:
        return [fn(s) if isinstance(s, dict) else "—" for s in results.values()]

    def rate(key, cpu_key):
        def cell(s):
            v, cpu = med(s, key), med(s, cpu_key)
            return f"{v:,.0f} ({cpu:.2f})" if v is not None else "—"

        return cell

    rows.append(
        (f"enqueue via services.job_enqueue, jobs/s (N={sizes['jobs']})", cells(rate("enqueue", "enqueue_cpu")), "")
    )
    one = cells(rate("claim_finish_1", "claim_finish_cpu_1"))
    sq = results.get("sqlite")
    verdict = ""
    if isinstance(sq, dict) and (v := med(sq, "claim_finish_1")) is not None:
        verdict = "PASS" if v >= SQLITE_ONE_PROCESS_TARGET else "MISS"
    rows.append(
        (
            f"claim+finish, 1 process, jobs/s (N={sizes['jobs']})",
            one,
            f"SQLite ≥ {SQLITE_ONE_PROCESS_TARGET}  {verdict}",
        )
    )
    rows.append(
        (
            f"claim+finish, 4 processes, jobs/s (N={sizes['jobs']})",
            cells(rate("claim_finish_4", "claim_finish_cpu_4")),
            "",
        )
    )

    def lat(label):
        def cell(s):
            p50, p99, q = med(s, f"p50_{label}"), med(s, f"p99_{label}"), med(s, f"query_{label}")
            return f"{p50:.2f} / {p99:.2f} ({q:.2f})" if p50 is not None else "—"

        return cell

    for depth in sizes["depths"]:
        rows.append((f"claim p50 / p99 (query p50) ms @ {depth:,} queued", cells(lat(depth)), ""))
    lo, hi = sizes["depths"][0], sizes["depths"][-1]

    def ratio(s):
        a, b = med(s, f"p50_{lo}"), med(s, f"p50_{hi}")
        return f"{b / a:.2f}" if a and b else "—"

    ratio_cells = cells(ratio)
    verdicts = [("PASS" if float(c) <= P50_RATIO_TARGET else "MISS") for c in ratio_cells if c != "—"]
    rows.append(
        (f"claim p50 @ {hi // 1000}k / p50 @ {lo // 1000}k", ratio_cells, f"≤ {P50_RATIO_TARGET}  {' '.join(verdicts)}")
    )
    rows.append(
        (
            f"claim p50 / p99 (query p50) ms, {hi:,} ineligible ahead",
            cells(lat("blocked")),
            "flat (DESIGN §4, no issue target)",
        )
    )

    def index(s):
        used = [all(s[f"index_{label}"]) for label in [*sizes["depths"], "blocked"]]
        return "yes" if all(used) else "NO"

    rows.append(("candidate query uses job_claim_order", cells(index), ""))
    rows.append(
        (
            f"bare sqlite3 claim+finish, jobs/s (N={sizes['bare_jobs']})",
            [
                rate("bare", "bare_cpu")(results["sqlite"]) if b == "sqlite" and isinstance(results[b], dict) else "—"
                for b in backends
            ],
            "physical ceiling",
        )
    )

    def share(s):
        a, b = med(s, "claim_finish_1"), med(s, "bare")
        return f"{a / b:.0%}" if a and b else "—"

    rows.append(("claim+finish 1 process / bare sqlite3", cells(share), ""))
    header = ("measurement", backends, "target")
    label_w = max(len(r[0]) for r in [*rows, header])
    col_w = [max(len(b), *(len(r[1][i]) for r in rows)) for i, b in enumerate(backends)]
    lines = []

    def line(label, values, target):
        parts = [label.ljust(label_w)] + [v.rjust(w) for v, w in zip(values, col_w, strict=True)] + [target]
        lines.append("  ".join(parts).rstrip())

    line(*header)
    lines.append("-" * (label_w + sum(w + 2 for w in col_w) + 24))
    for row in rows:
        line(*row)
    notes = [f"{b}: {s}" for b, s in results.items() if isinstance(s, str)]
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines)


def environment_line(repeat: int) -> str:
    return (
        f"environment: {os.cpu_count()} CPUs, Python {platform.python_version()}, SQLite {sqlite3.sqlite_version},"
        f" {postgres_version()}; {'medians of ' + str(repeat) + ' runs' if repeat > 1 else '1 run (use --repeat N for medians)'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (depths 1k/10k) for a fast smoke run")
    parser.add_argument("--repeat", type=int, default=1, help="run each measurement N times and report medians")
    parser.add_argument("--json", metavar="PATH", help="also write every raw sample to PATH")
    parser.add_argument("--depths", metavar="N,N,…", help="queue depths for the claim latency (default 1k,10k,100k)")
    parser.add_argument("--threads", type=int, default=1, help="claim+finish: job threads per claimer process"
                        " (> 1: the embedded worker's pattern, calls sharing commits through a GroupCommitter)")
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.depths:
        try:
            sizes["depths"] = sorted(int(d.replace("_", "")) for d in args.depths.split(","))
        except ValueError:
            parser.error(f"--depths: whole numbers separated by commas, got {args.depths!r}")
    sizes["threads"] = args.threads
    wanted = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]

    env = environment_line(args.repeat)
    print(env, flush=True)
    started = time.monotonic()
    results: dict[str, dict | str] = {}
    for name in wanted:
        if name == "postgres" and not postgres_binaries():
            results[name] = "skipped: no PostgreSQL server binaries found (tests.pgcluster.find_bindir)"
            continue
        backend = SqliteBackend() if name == "sqlite" else PostgresBackend()
        try:
            results[name] = measure_backend(backend, sizes, args.repeat)
        finally:
            backend.close()

    print()
    print(render(results, sizes, args.repeat))
    print()
    notes = [
        "jobs/s (CPU ms per job, summed over the processes: the part other processes' load does not change).",
        "enqueue: tasks pre-created by bulk_create (untimed), then one services.job_enqueue call per job, one process.",
        "claim+finish: N jobs enqueued through the services, then P claimer processes (own Django setup and"
        " connection, one worker each, no limits) loop claim_round(max_jobs=1) -> attempt_finish(succeeded)"
        " (with --threads T: T job threads and a claim of every free slot, sharing commits) until a round"
        " comes back starved; jobs/s = N / (last end - first start).",
        f"latency: DEPTH+{sizes['claims'] + sizes['warmup'] + 1} queued jobs bulk-filled (one RequirementSet;"
        f" 'ineligible ahead': {sizes['depths'][-1]:,} older jobs needing runner:codex, which the worker lacks),"
        f" {sizes['warmup']} warm-up claims, then {sizes['claims']} timed jobs_claim calls, each followed by an"
        f" untimed finish, in batches of {sizes['batch']} interleaved across the depths. 'query' is the candidate"
        " SELECT alone; the rest of a claim is mostly the commit's fsync, which other processes on a shared"
        " machine slow down. PostgreSQL tables are ANALYZEd after the fill.",
    ]
    print("\n".join(notes))
    for name, samples in results.items():
        if isinstance(samples, dict):
            db = samples["db"][0]
            hi = sizes["depths"][-1]
            print(f"{name} settings: {db}")
            print(f"{name} claim plan @ {hi:,}: " + " | ".join(samples[f"plan_{hi}"][0]))
    print(f"wall time: {time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "sizes": sizes, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

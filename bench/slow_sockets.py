"""Black-box probe: does the control plane keep answering while slow and idle
sockets hang on to it?

    .venv/bin/python bench/slow_sockets.py [--backend sqlite|postgres] [--slow 200] [--idle 2000]
        [--byte-every 3] [--baseline 5] [--duration 60] [--probe-timeout 10] [--markdown PATH]
    .venv/bin/python bench/slow_sockets.py --url http://HOST:PORT --token TOKEN [--pool POOL] …

By default it starts a control plane of its own (`apiary run`, embedded worker
off, lease 30 s / heartbeat 10 s; SQLite, or PostgreSQL on a throwaway
cluster from tests/pgcluster.py) with one queued job. It registers a probe
worker over the protocol and claims that job, so it holds a real attempt. With
`--url`/`--token` it probes a running control plane instead, and needs a job
that a worker in `--pool` can claim within 30 s for the heartbeat probe.

Then: `--baseline` seconds of probes alone; then it opens `--slow` sockets that
send one byte of a request header every `--byte-every` seconds with no token
(a slowloris) and `--idle` sockets that send nothing, and keeps them open for
`--duration` seconds. Every second, on a fresh connection each and without
waiting for the previous one, it issues `GET status` (with the token) and an
attempt heartbeat. It reports answered/unanswered probes (unanswered = no
answer within `--probe-timeout`), the latency p50/p99/max of answered ones,
and how many slow/idle sockets the server closed, after how long. Progress
goes to stderr, the Markdown table to stdout. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import errno
import json
import os
import platform
import resource
import secrets
import selectors
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import requests
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.fleet_processes import apiary, clean_env, free_port, log  # noqa: E402 - after the path
from tests import pgcluster  # noqa: E402

PROTOCOL = "/api/worker/v1/"


# --------------------------------------------------------------------------- a control plane of our own


def start_control_plane(root: Path, database_url: str | None, *, extra_env: dict[str, str] | None = None,
                        ) -> tuple[subprocess.Popen, str, str]:
    """`apiary run` on a project in `root`; `extra_env` for the child (e.g. PYTHONPATH: another checkout)."""
    port, token = free_port(), secrets.token_urlsafe(24)
    (root / "inbox").mkdir()
    config = {
        "project": "slow-sockets",
        "settings": {"concurrency": 0, "queue": {
            "embedded_worker": False, "listen": f"127.0.0.1:{port}", "worker_token": token,
            "lease_duration": "30s", "heartbeat_interval": "10s",
        }},
        "agents": [{"id": "probe", "runner": "shell", "command": "cat", "worker_pool": "probe"}],
        # Nothing runs it: the probe claims the job over the protocol and only heartbeats its attempt.
        "workflows": [{"id": "held", "agent": "probe", "steps": [{"id": "work", "run": "true", "timeout": "1h"}]}],
        "sources": [{"id": "inbox", "type": "directory", "path": "inbox", "pattern": "*.md", "poll_interval": "0.5s",
                     "workflows": ["held"]}],
    }
    path = root / "apiary.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(config)), sort_keys=False))  # no anchors: apiary refuses them
    (root / "inbox" / "held.md").write_text("# held by the probe\n")
    env = ({"DATABASE_URL": database_url} if database_url else {}) | (extra_env or {})
    with open(root / "controlplane.log", "wb") as out:
        proc = subprocess.Popen(apiary("run", "--config", str(path)), cwd=root, env=clean_env(**env),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", token


def wait_serving(url: str, token: str, proc: subprocess.Popen | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"apiary run exited {proc.returncode}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + PROTOCOL + "status", headers=auth(token), timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} did not serve GET status within {timeout:g}s")


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


# What a worker able to run a shell-runner workflow advertises (workflows/services.py worker_capabilities).
CAPABILITIES = ["apiary.workflow", "runner:shell"]


def hold_attempt(url: str, token: str, pool: str) -> dict | None:
    """Register a probe worker and claim one job: {"attempt_id", "token", "credential"}, or None when nothing
    came. `credential` is the probe worker's own (the shared token only enrols); older code gave none."""
    worker_id = f"slow-sockets-probe-{os.getpid()}"
    answer = requests.post(url + PROTOCOL + "workers/register", headers=auth(token), timeout=30, json={
        "worker_id": worker_id, "pool": pool, "labels": [], "capabilities": CAPABILITIES, "capacity": 1,
        "version": "slow-sockets", "hostname": platform.node(), "pid": os.getpid(),
    })
    answer.raise_for_status()
    session = answer.json()["session"]
    token = answer.json().get("credential") or token
    answer = requests.post(url + PROTOCOL + "claims", headers=auth(token), timeout=45, json={
        "worker_id": worker_id, "session": session, "max_jobs": 1, "wait": 30,
    })
    answer.raise_for_status()
    jobs = answer.json()["jobs"]
    return {"attempt_id": jobs[0]["attempt_id"], "token": jobs[0]["token"], "credential": token} if jobs else None


# --------------------------------------------------------------------------- the sockets


class Hangers:
    """Slow and idle sockets, all driven from one thread with a selector."""

    def __init__(self, host: str, port: int, *, slow: int, idle: int, byte_every: float):
        self.host, self.port, self.byte_every = host, port, byte_every
        self.header = (f"GET {PROTOCOL}status HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: slow-sockets\r\n"
                       "X-Padding: " + "a" * 4000 + "\r\n\r\n").encode()
        self.counts = {"slow": slow, "idle": idle}
        self.opened: dict[socket.socket, dict] = {}
        self.failed_to_open = {"slow": 0, "idle": 0}
        self.closed: dict[str, list[float]] = {"slow": [], "idle": [], }
        self.answered: dict[str, int] = {"slow": 0, "idle": 0}  # the server wrote something (e.g. 400/408)
        self.selector = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hangers", daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.ready.wait()

    def _open(self, kind: str) -> None:
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect((self.host, self.port))
        except OSError:
            self.failed_to_open[kind] += 1
            s.close()
            return
        s.setblocking(False)
        self.opened[s] = {"kind": kind, "at": time.monotonic(), "sent": 0}
        self.selector.register(s, selectors.EVENT_READ)

    def _closed(self, s: socket.socket) -> None:
        info = self.opened.pop(s)
        self.closed[info["kind"]].append(time.monotonic() - info["at"])
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(s)
        s.close()

    def _run(self) -> None:
        for kind in ("slow", "idle"):
            for _ in range(self.counts[kind]):
                self._open(kind)
        self.ready.set()
        next_byte = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_byte:
                next_byte = now + self.byte_every
                for s, info in list(self.opened.items()):
                    if info["kind"] != "slow" or info["sent"] >= len(self.header):
                        continue
                    try:
                        s.send(self.header[info["sent"] : info["sent"] + 1])
                        info["sent"] += 1
                    except BlockingIOError:
                        pass
                    except OSError:
                        self._closed(s)
            for key, _ in self.selector.select(timeout=min(0.2, max(0.0, next_byte - time.monotonic()))):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.ECONNRESET, errno.EPIPE):
                        raise
                    data = b""
                if data:
                    self.answered[self.opened[s]["kind"]] += 1
                    continue
                self._closed(s)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for s in list(self.opened):
            s.close()
        self.selector.close()

    def still_open(self, kind: str) -> int:
        return sum(info["kind"] == kind for info in self.opened.values())


# --------------------------------------------------------------------------- the probes


class Probes:
    """One status and one heartbeat probe per second, each on its own thread and connection."""

    def __init__(self, url: str, token: str, attempt: dict | None, *, timeout: float):
        self.url, self.token, self.attempt, self.timeout = url, token, attempt, timeout
        self.results: list[dict] = []  # {"kind", "phase", "latency", "status", "error"}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.phase = "baseline"

    def _one(self, kind: str, phase: str) -> None:
        started = time.monotonic()
        result = {"kind": kind, "phase": phase, "latency": None, "status": None, "error": None}
        try:
            with requests.Session() as session:  # a fresh connection, as a newly arriving worker has
                if kind == "status":
                    answer = session.get(self.url + PROTOCOL + "status", headers=auth(self.token),
                                         timeout=(self.timeout, self.timeout))
                else:
                    answer = session.post(self.url + PROTOCOL + f"attempts/{self.attempt['attempt_id']}/heartbeat",
                                          headers=auth(self.attempt["credential"]), json={"token": self.attempt["token"]},
                                          timeout=(self.timeout, self.timeout))
            result["status"] = answer.status_code
            result["latency"] = time.monotonic() - started
        except requests.RequestException as exc:
            result["error"] = type(exc).__name__
        with self.lock:
            self.results.append(result)

    def fire(self) -> None:
        for kind in ("status", "heartbeat") if self.attempt else ("status",):
            thread = threading.Thread(target=self._one, args=(kind, self.phase), daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=self.timeout * 2 + 5)

    def summary(self, kind: str, phase: str) -> dict:
        rows = [r for r in self.results if r["kind"] == kind and r["phase"] == phase]
        answered = [r for r in rows if r["status"] is not None]
        latencies = sorted(r["latency"] for r in answered)

        def pct(p: float) -> str:
            if not latencies:
                return "–"
            return f"{latencies[min(len(latencies) - 1, int(round(p * (len(latencies) - 1))))] * 1000:.0f}"

        return {
            "sent": len(rows),
            "ok": sum(200 <= r["status"] < 300 for r in answered),
            "other": ", ".join(sorted({str(r["status"]) for r in answered if not 200 <= r["status"] < 300})) or "–",
            "other_n": sum(not 200 <= r["status"] < 300 for r in answered),
            "unanswered": len(rows) - len(answered),
            "p50": f"{statistics.median(latencies) * 1000:.0f}" if latencies else "–",
            "p99": pct(0.99),
            "max": f"{latencies[-1] * 1000:.0f}" if latencies else "–",
        }


def close_times(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    return (f"{len(values)} (after {values[0]:.1f}s min, {statistics.median(values):.1f}s median, "
            f"{values[-1]:.1f}s max)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--url", help="probe this running control plane instead of starting one")
    parser.add_argument("--token", help="its worker token (with --url)")
    parser.add_argument("--pool", default="probe", help="the probe worker's pool (with --url)")
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--byte-every", type=float, default=3.0)
    parser.add_argument("--baseline", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--probe-timeout", type=float, default=10.0)
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    args = parser.parse_args()
    if args.url and not args.token:
        parser.error("--url needs --token")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = args.slow + args.idle + 512
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, needed), hard))

    root = Path(tempfile.mkdtemp(prefix="apiary-slow-"))
    cluster = proc = None
    note = "a running control plane"
    try:
        if args.url:
            url, token = args.url.rstrip("/"), args.token
            wait_serving(url, token, None)
        else:
            database_url = None
            note = "SQLite"
            if args.backend == "postgres":
                cluster = pgcluster.start_cluster()
                database_url = cluster.create_database("apiary_slow")
                note = f"PostgreSQL {pgcluster.server_version(cluster.bindir)}"
            proc, url, token = start_control_plane(root, database_url)
            wait_serving(url, token, proc)
        attempt = hold_attempt(url, token, args.pool)
        log(f"serving at {url}; holding attempt {attempt['attempt_id'] if attempt else '(none: status only)'}")
        target = urlsplit(url)
        probes = Probes(url, token, attempt, timeout=args.probe_timeout)

        def probe_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            tick = time.monotonic()
            while tick < end:
                probes.fire()
                tick += 1.0
                time.sleep(max(0.0, tick - time.monotonic()))

        probe_for(args.baseline)
        hangers = Hangers(target.hostname, target.port or 80, slow=args.slow, idle=args.idle,
                          byte_every=args.byte_every)
        opened_at = time.monotonic()
        hangers.start()
        log(f"{len(hangers.opened)} sockets open after {time.monotonic() - opened_at:.1f}s "
            f"(failed to connect: {hangers.failed_to_open}); probing for {args.duration:g}s")
        probes.phase = "attack"
        probe_for(args.duration)
        probes.join()
        hangers.close()
        ended = {k: hangers.still_open(k) for k in ("slow", "idle")}
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if cluster:
            cluster.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)

    command = " ".join(shlex.quote(a) for a in ["bench/slow_sockets.py", *sys.argv[1:]])
    lines = [
        f"### Slow sockets: {args.slow} slow (1 byte / {args.byte_every:g}s, no token) + {args.idle} idle, "
        f"{args.duration:g}s ({note})",
        "",
        f"`{command}` — {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
        f"probe timeout {args.probe_timeout:g}s, APIARY_HTTP_WORKERS={os.environ.get('APIARY_HTTP_WORKERS', 'default')}",
        "",
        "| probe | phase | sent | answered 2xx | answered other | unanswered | p50 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in ("status", "heartbeat"):
        for phase in ("baseline", "attack"):
            s = probes.summary(kind, phase)
            if not s["sent"]:
                continue
            other = f"{s['other_n']} ({s['other']})" if s["other_n"] else "0"
            lines.append(f"| {kind} | {phase} | {s['sent']} | {s['ok']} | {other} | {s['unanswered']} | "
                         f"{s['p50']} | {s['p99']} | {s['max']} |")
    lines += [
        "",
        "| sockets | opened | closed by the server | wrote something back | still open at the end |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind in ("slow", "idle"):
        opened = hangers.counts[kind] - hangers.failed_to_open[kind]
        lines.append(f"| {kind} | {opened} | {close_times(hangers.closed[kind])} | {hangers.answered[kind]} | "
                     f"{ended[kind]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()

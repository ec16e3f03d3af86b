"""Fleet benchmark: N simulated remote workers speaking protocol v1 to a real control plane.

    .venv/bin/python bench/fleet.py [--backend sqlite|postgres|all] [--workers 1000] [--busy 500]
        [--duration 300] [--pickup-probes 10] [--repeat R] [--json PATH] [--source-tree DIR]

Prints a Markdown table on stdout (progress on stderr); asserts nothing.

What one run does, per backend:

1. Writes a temporary project (apiary.yaml: `listen` on a free loopback port,
   `worker_token`, `embedded_worker: false`, the lease / heartbeat / worker
   timeout from the flags, one shell agent and workflow, no sources) and
   starts `apiary run` on it as a child process, with `APIARY_HTTP_WORKERS`
   set from `--listener-processes` (plus `--cp-env KEY=VALUE` extras), and
   `PYTHONPATH` = `--source-tree` (default: this checkout): point it at
   another worktree to measure that code. PostgreSQL runs use a throwaway
   cluster (tests/pgcluster.py) and `DATABASE_URL`.
2. Starts an enqueue helper: a child Python process running from the same
   source tree, with Django set up on the same database, which enqueues jobs
   with `jobqueue.services.job_enqueue` on request and reports
   `time.monotonic()` (a system-wide clock, the same in every process) just
   before and just after the call; the job is committed when the call returns.
3. Enqueues `--busy` jobs, then starts `--workers` simulated workers in one
   asyncio process, their start-ups spread evenly over `--ramp` seconds. Each
   worker speaks raw HTTP/1.1 with keep-alive on two connections of its own,
   as the real worker does: one for register, worker heartbeats, attempt
   heartbeats and finishes (one request at a time), one for `POST claims`.
   It registers (retried with backoff until it succeeds), beats every
   `heartbeat_interval`, and while it holds no job long-polls `POST claims`
   with `--wait`. Holding a job, it beats the attempt every
   `heartbeat_interval` and finishes `succeeded` after `--hold` seconds
   (default: until the end of the run, so `--busy` workers stay busy); it
   self-fences (drops the job unfinished, counted) once `lease_duration` has
   passed since the sending time of its last acknowledged attempt heartbeat.
   Timeouts are those of workers/http.py: heartbeats one heartbeat interval,
   claims wait + 15 s, register and finish 15 s (finish retried 4 times).
4. Steady state (`--duration` s, counted from when `--busy` workers hold a job
   or 60 s after the ramp, whichever comes first): `--pickup-probes` single
   jobs, evenly spaced, each finished at once by whoever claims it. The last
   `--quiet-window` seconds have no enqueues at all: only idle workers
   waiting and busy workers beating.
5. End: every busy worker finishes its job (spread over a few seconds), then
   everything stops: workers, helper, control plane (SIGTERM, then SIGKILL to
   its process group), cluster. Ctrl-C stops them too.

Columns (rows of the table; with --repeat, the median of the runs):

* `<call> ms p50/p99/max (n)`: wall time from writing the request to having
  read the whole answer, over every call of that kind in the run, whatever
  the answer (errors and timeouts included, a timeout counting as its
  timeout). Calls still in flight when the run stops (idle workers' last
  long-polls) have no latency and are left out of `n`. `claim` includes the
  long-poll wait: an idle worker's claim lasts about `--wait`. `claims with a
  job`: claim answers that leased a job.
* `pickup ms p50/p99/max`: probe job committed (enqueue call returned in the
  helper) → a waiting worker has read the claim answer containing it.
  `probes picked/sent`: probes whose claim answer arrived before the end.
* `stale answers to live workers`: 409 `stale_attempt` on an attempt
  heartbeat or finish. Every simulated worker is alive, so any is a lease the
  control plane let run out under a working worker; must be 0.
  `leases expired under live workers`: attempts in state `expired` in the
  database at the end (counted by the helper); every simulated worker is
  alive and registers once, so each is a lease lost to the control plane's
  slowness; must be 0. A worker that self-fences stops beating, so its lost
  lease shows here and not as a stale answer; so does the lease of a claim
  the server answered after the worker's timeout (it never saw the token).
  `self-fenced`: jobs a worker dropped, as workers/runtime.py does, because
  no attempt heartbeat was acknowledged within the lease less a margin
  (min(2 s, 10 %)); a failed attempt heartbeat is retried after
  min(1 s, heartbeat/2), as the real worker does. `session_superseded`: 409 of that code.
* `other 4xx`, `5xx`: other answers by status. `timeouts`: calls that got no
  complete answer within their timeout (connection dropped and reopened).
  `transport errors`: refused / reset / malformed connections.
* `control plane CPU s / 1k requests`: utime+stime (with reaped children) of
  the `apiary run` process tree from the start of the ramp to the end of the
  run, per 1,000 requests the simulator sent in that time. `peak RSS` is the
  largest sum of RSS over that tree, sampled every 2 s (shared pages of
  forked processes count in each). `PostgreSQL server CPU`: the same CPU
  figure for the cluster's processes (their summed RSS is in --json only:
  shared_buffers counts once per backend there).
* `quiet window`: in the last `--quiet-window` seconds of the steady state,
  per second: `claim requests` the simulator sent (each a long-poll: this is
  the fleet's demand, not the control plane's database work),
  worker / attempt heartbeats sent, and on PostgreSQL
  `xact_commit` from pg_stat_database (every committed transaction in the
  database, the daemon's reaper included): how much database work idle
  waiting costs. Statistics reach pg_stat_database when a backend flushes
  them (at most about a second late while busy), so short windows are rough.
  SQLite keeps no such counter: `—`.
  `claim transactions/s (server side)`: with `--count-claim-rounds` (the
  default) the control plane runs with `APIARY_LOG_LEVEL=DEBUG`, and the
  DEBUG lines `apiary.queue.claims` logs once per claim transaction of a
  long-poll (`claim round: worker <id>, <n> job(s)`, from every listener
  process, into the control plane's log) are counted by their timestamps
  inside the quiet window, on either backend. Code that logs no such line
  (its jobqueue/longpoll.py lacks it: the polling long-poll before the
  notifier, which ran a claim every ~0.3 s per waiting long-poll) gets `—`
  and keeps its usual log level. `control-plane log`: its ERROR / CRITICAL
  lines (gunicorn's `[CRITICAL] WORKER TIMEOUT` included) and tracebacks over
  the run, its WARNING lines (lease expiries, a database pool timing out), and
  DEBUG lines other than claim rounds (these must stay few for the log level
  to be harmless).
* `simulator CPU`: CPU seconds of this process (the simulated fleet) and of
  the enqueue helper over the run, and as a share of one core: the simulator
  shares the machine's cores with the control plane, so it should stay small.
  `event-loop lag`: how late a 100 ms sleep of the simulator wakes; every
  latency above includes up to that much of the simulator's own delay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import resource
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
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = "/api/worker/v1/"
CAPABILITIES = ["apiary.workflow", "runner:shell"]
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
KINDS = ("register", "worker_heartbeat", "claim", "attempt_heartbeat", "finish")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- HTTP/1.1 over asyncio streams


class CallTimeout(Exception):
    pass


class TransportFailure(Exception):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time (callers hold `lock`)."""

    def __init__(self, host: str, port: int, token: str):
        self.host, self.port = host, port
        self.auth = f"Bearer {token}"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()
        self.used = 0  # requests answered on the current connection

    def close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.transport.abort()
        self.reader = self.writer = None
        self.used = 0

    async def request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict | None]:
        """(status, JSON body or None). Raises CallTimeout or TransportFailure
        (the connection is closed then). A reused connection that the server
        closed while idle (EOF before any byte of the answer) is reopened and
        the request sent once more: nothing reached the application."""
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            reused = self.writer is not None and self.used > 0
            try:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                    return await self._exchange(method, path, body)
            except TimeoutError:
                self.close()
                raise CallTimeout() from None
            except _IdleClosed:
                self.close()
                if not reused or attempt == 2:
                    raise TransportFailure("connection closed before the answer") from None
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                self.close()
                raise TransportFailure(f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, body: dict | None) -> tuple[int, dict | None]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = (
            f"{method} {API}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: {self.auth}\r\n"
            f"Accept: application/json\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise _IdleClosed()
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            raw = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            raw = b""
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                raw += chunk[:-2]
        else:
            raw = await self.reader.read()
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            self.close()
        else:
            self.used += 1
        try:
            document = json.loads(raw) if raw else None
        except ValueError:
            document = None
        return status, document


class _IdleClosed(Exception):
    pass


# --------------------------------------------------------------------------- process tree sampling


def _proc_table() -> dict[int, tuple[int, float, int]]:
    """pid → (ppid, CPU seconds incl. reaped children, RSS bytes) of every process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[0] is state (field 3); ppid is field 4, utime..cstime 14..17, rss 24.
        cpu = sum(int(x) for x in fields[11:15]) / CLK_TCK
        table[int(entry)] = (int(fields[1]), cpu, int(fields[21]) * PAGE)
    return table


def tree_usage(root: int | None) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) summed over `root` and its descendants."""
    if root is None:
        return 0.0, 0
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    cpu, rss, todo = 0.0, 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            cpu += table[pid][1]
            rss += table[pid][2]
        todo += children.get(pid, [])
    return cpu, rss


def process_cpu(pid: int) -> float:
    """utime+stime of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- control plane and helper

HELPER = r"""
import json, os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
import django
django.setup()
from apiary_site import bootstrap
config = bootstrap.configure(os.environ["APIARY_CONFIG"])
from django.db import connection
from jobqueue import services

def answer(document):
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()

answer({"ready": True})
for line in sys.stdin:
    command, _, tag = line.strip().partition(" ")
    try:
        if command == "ENQ":
            t0 = time.monotonic()
            job, _ = services.job_enqueue(
                key=f"fleet:{tag}", payload={"fleet_bench": tag}, project=config.project,
                source="fleet", agent="bench", runner="shell",
            )
            answer({"tag": tag, "job": job.pk, "t0": t0, "t1": time.monotonic()})
        elif command == "XACT":
            value = None
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
                    value = cursor.fetchone()[0]
            answer({"tag": tag, "xact": value, "t": time.monotonic()})
        elif command == "EXPIRED":
            from jobqueue.models import Attempt
            answer({"tag": tag, "expired": Attempt.objects.filter(state="expired").count()})
    except Exception as exc:
        answer({"tag": tag, "error": repr(exc)})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seconds(value: float) -> str:
    return f"{value:g}s"


def write_project(root: str, *, port: int, token: str, args) -> str:
    config = f"""\
# Written by bench/fleet.py: a control plane for simulated remote workers, no sources.
project: fleetbench
settings:
  concurrency: 0
  queue:
    listen: 127.0.0.1:{port}
    worker_token: {token}
    embedded_worker: false
    lease_duration: {seconds(args.lease)}
    heartbeat_interval: {seconds(args.heartbeat)}
    worker_timeout: {seconds(args.worker_timeout or 3 * args.heartbeat)}
agents:
  - id: bench
    runner: shell
    command: cat
workflows:
  - id: bench
    agent: bench
    steps:
      - id: noop
        run: "true"
"""
    path = os.path.join(root, "apiary.yaml")
    with open(path, "w") as f:
        f.write(config)
    return path


def child_env(args, extra: dict[str, str]) -> dict[str, str]:
    """Our environment without APIARY_*/DJANGO_*/DATABASE_URL, running the code of `--source-tree`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"}
    env["PYTHONPATH"] = args.source_tree
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def apiary(*words: str) -> list[str]:
    # -P: the working directory must not shadow the packages of --source-tree.
    return [sys.executable, "-P", "-c", "from apiary_site.cli import main; main()", *words]


CLAIM_LINE = "apiary.queue.claims claim round: "  # logger name and message of jobqueue/longpoll.py
# Django's format (`… ERROR apiary.api …`) and gunicorn's (`[…] [pid] [CRITICAL] WORKER TIMEOUT …`).
ERROR_LEVELS = (" ERROR ", " CRITICAL ", "[ERROR]", "[CRITICAL]")


def logs_claim_rounds(tree: str) -> bool:
    """Whether the code in `tree` logs one DEBUG line per claim transaction of a long-poll."""
    try:
        with open(os.path.join(tree, "jobqueue", "longpoll.py")) as f:
            return "claim round: " in f.read()
    except OSError:
        return False


def _log_time(line: str) -> float | None:
    """The epoch seconds of a line in the settings' format (`%(asctime)s …`, local time), or None."""
    try:
        return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def scan_log(path: str, window: tuple[float, float]) -> dict:
    """Claim-round lines in the control plane's log, in `window` (epoch seconds) and in all; other
    DEBUG lines; ERROR/CRITICAL lines and tracebacks (with the first few of them)."""
    out = {
        "claim_rounds_window": 0, "claim_rounds_total": 0, "debug_other": 0, "errors": 0, "warnings": 0,
        "error_samples": [],
    }
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        if CLAIM_LINE in line:
            out["claim_rounds_total"] += 1
            at = _log_time(line)
            if at is not None and window[0] <= at < window[1]:
                out["claim_rounds_window"] += 1
        elif " DEBUG " in line[:40]:
            out["debug_other"] += 1
        elif any(level in line[:48] for level in ERROR_LEVELS) or line.startswith("Traceback"):
            out["errors"] += 1
            if len(out["error_samples"]) < 5:
                out["error_samples"].append(line.rstrip()[:300])
        elif " WARNING " in line[:40] or "[WARNING]" in line[:48]:
            out["warnings"] += 1
    return out


class ControlPlane:
    def __init__(self, root: str, args, *, backend: str, database_url: str | None, processes: int):
        self.root = root
        self.port = free_port()
        self.token = "fleet-" + secrets.token_hex(16)
        self.config = write_project(root, port=self.port, token=self.token, args=args)
        env = {"APIARY_HTTP_WORKERS": str(processes)}
        if database_url:
            env["DATABASE_URL"] = database_url
        # One DEBUG line per claim transaction of a long-poll (apiary.queue.claims), if the code logs it.
        self.counts_claims = args.count_claim_rounds and logs_claim_rounds(args.source_tree)
        if self.counts_claims:
            env["APIARY_LOG_LEVEL"] = "DEBUG"
        env.update(dict(item.split("=", 1) for item in args.cp_env))
        self.env = child_env(args, env)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(root, "controlplane.log")

    def check(self) -> None:
        result = subprocess.run(
            apiary("check", "--config", self.config), cwd=self.root, env=self.env, capture_output=True, text=True,
            timeout=120, check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"apiary check failed:\n{result.stdout}{result.stderr}")

    def start(self, timeout: float = 120) -> None:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                apiary("run", "--config", self.config), cwd=self.root, env=self.env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{API}status", headers={"Authorization": f"Bearer {self.token}"}
        )
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"apiary run exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(request, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the control plane did not serve GET status within {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                log("control plane did not stop within 20 s of SIGTERM: SIGKILL")
        # Whatever is left of its process group (the listener and its workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Helper:
    """The enqueue helper (HELPER above) as an asyncio child; answers are matched to requests by tag."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[str, asyncio.Future] = {}
        self.reader_task: asyncio.Task | None = None

    async def start(self) -> None:
        env = dict(self.cp.env, APIARY_CONFIG=self.cp.config)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-c", HELPER, cwd=self.cp.root, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
        )
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError("the enqueue helper did not start")
        self.reader_task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            document = json.loads(line)
            future = self.pending.pop(document.get("tag"), None)
            if future and not future.done():
                future.set_result(document)

    async def call(self, command: str, tag: str, timeout: float = 60) -> dict:
        future = asyncio.get_running_loop().create_future()
        self.pending[tag] = future
        self.proc.stdin.write(f"{command} {tag}\n".encode())
        await self.proc.stdin.drain()
        try:
            document = await asyncio.wait_for(future, timeout)
        finally:
            self.pending.pop(tag, None)
        if "error" in document:
            raise RuntimeError(f"helper {command} {tag}: {document['error']}")
        return document

    def cpu(self) -> float:
        return process_cpu(self.proc.pid) if self.proc else 0.0

    async def stop(self) -> None:
        if self.reader_task:
            self.reader_task.cancel()
        if self.proc and self.proc.returncode is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


# --------------------------------------------------------------------------- the simulated fleet


class Fleet:
    def __init__(self, args, cp: ControlPlane, helper: Helper):
        self.args = args
        self.cp = cp
        self.helper = helper
        self.calls: dict[str, list[tuple[float, float, str]]] = {k: [] for k in KINDS}  # (sent, seconds, outcome)
        self.sent: dict[str, list[float]] = {k: [] for k in KINDS}  # every request at sending, answered or not
        self.counts: dict[str, int] = {"claimed": 0, "self_fenced": 0, "registered": 0}
        self.held = 0
        self.finishing = asyncio.Event()
        self.probe_commit: dict[str, float] = {}
        self.pickups: list[float] = []
        self.probes_sent = 0
        self.early_pickups: dict[str, float] = {}  # probe answers read before the helper reported the commit

    def record(self, kind: str, sent: float, took: float, outcome: str) -> None:
        self.calls[kind].append((sent, took, outcome))

    async def call(self, conn: Connection, kind: str, path: str, body: dict | None, timeout: float):
        """One protocol call, recorded; (status, document) or (None, None) on timeout or transport failure."""
        async with conn.lock:
            sent = time.monotonic()
            self.sent[kind].append(sent)
            try:
                status, document = await conn.request("POST", path, body, timeout)
            except CallTimeout:
                self.record(kind, sent, time.monotonic() - sent, "timeout")
                return None, None
            except TransportFailure:
                self.record(kind, sent, time.monotonic() - sent, "transport")
                return None, None
        took = time.monotonic() - sent
        if status < 400:
            outcome = "ok"
        elif status < 500:
            code = ((document or {}).get("error") or {}).get("code", "") if isinstance(document, dict) else ""
            outcome = f"4xx:{code or status}"
        else:
            outcome = f"5xx:{status}"
        self.record(kind, sent, took, outcome)
        return status, document

    def probe_seen(self, tag: str, at: float) -> None:
        if tag in self.probe_commit:
            self.pickups.append(at - self.probe_commit.pop(tag))
        else:
            self.early_pickups[tag] = at

    async def probe(self, n: int) -> None:
        tag = f"probe-{n}"
        self.probes_sent += 1
        try:
            document = await self.helper.call("ENQ", tag)
        except (TimeoutError, RuntimeError) as exc:
            log(f"probe {n}: enqueue failed: {exc!r}")
            return
        if tag in self.early_pickups:  # answered before we heard of the commit: latency below our resolution
            self.pickups.append(max(0.0, self.early_pickups.pop(tag) - document["t1"]))
        else:
            self.probe_commit[tag] = document["t1"]


class SimWorker:
    def __init__(self, fleet: Fleet, n: int):
        self.fleet = fleet
        args = fleet.args
        self.id = f"sim-{n:05d}"
        self.quick = Connection("127.0.0.1", fleet.cp.port, fleet.cp.token)
        self.poll = Connection("127.0.0.1", fleet.cp.port, fleet.cp.token)
        self.session: str | None = None
        self.hb = args.heartbeat
        self.lease = args.lease
        self.rng = random.Random(n)

    @property
    def fence_after(self) -> float:
        """As workers/runtime.py, less the step's grace (no step runs here): lease less a margin."""
        return self.lease - min(2.0, self.lease * 0.1)

    def close(self) -> None:
        self.quick.close()
        self.poll.close()

    async def run(self, delay: float) -> None:
        await asyncio.sleep(delay)
        backoff = 0.5
        while self.session is None:
            body = {
                "worker_id": self.id, "pool": None, "labels": [], "capabilities": CAPABILITIES, "capacity": 1,
                "version": "fleet-bench", "hostname": "fleet-bench", "pid": os.getpid(),
            }
            status, document = await self.fleet.call(self.quick, "register", "workers/register", body, 15)
            if status == 200:
                self.session = document["session"]
                if document.get("credential"):  # its own from now on (code before per-worker credentials gave none)
                    for connection in (self.quick, self.poll):
                        connection.auth = f"Bearer {document['credential']}"
                self.hb = float(document.get("heartbeat_interval", self.hb))
                self.lease = float(document.get("lease_duration", self.lease))
                self.fleet.counts["registered"] += 1
            else:
                await asyncio.sleep(backoff * self.rng.uniform(0.5, 1.5))
                backoff = min(backoff * 2, 10)
        beats = asyncio.create_task(self.beat())
        try:
            await self.work()
        finally:
            beats.cancel()

    async def beat(self) -> None:
        next_at = time.monotonic() + self.hb * self.rng.uniform(0.5, 1.0)
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += self.hb
            body = {"session": self.session, "draining": False, "ready": True}
            await self.fleet.call(
                self.quick, "worker_heartbeat", f"workers/{self.id}/heartbeat", body, max(1.0, self.hb)
            )
            next_at = max(next_at, time.monotonic())

    async def work(self) -> None:
        args, fleet = self.fleet.args, self.fleet
        backoff = 0.5
        while not fleet.finishing.is_set():
            body = {"worker_id": self.id, "session": self.session, "max_jobs": 1, "wait": args.wait}
            sent = time.monotonic()
            status, document = await fleet.call(self.poll, "claim", "claims", body, args.wait + 15)
            received = time.monotonic()
            if status != 200:
                await asyncio.sleep(backoff * self.rng.uniform(0.5, 1.5))
                backoff = min(backoff * 2, 10)
                continue
            backoff = 0.5
            jobs = (document or {}).get("jobs") or []
            if not jobs:
                if received - sent < 0.1 * args.wait:  # an empty answer that did not wait: do not spin
                    await asyncio.sleep(0.1 * args.wait)
                continue
            for job in jobs:
                fleet.counts["claimed"] += 1
                tag = str(job.get("fleet_bench", ""))
                if tag.startswith("probe-"):
                    fleet.probe_seen(tag, received)
                    await self.finish(job)
                else:
                    await self.hold(job, sent)

    async def hold(self, job: dict, claim_sent: float) -> None:
        fleet, args = self.fleet, self.fleet.args
        fleet.held += 1
        try:
            acked = claim_sent  # the lease started no earlier than the claim was sent
            until = time.monotonic() + args.hold if args.hold is not None else float("inf")
            next_beat = time.monotonic()  # a claim answered late in a long poll is confirmed at once
            while True:
                now = time.monotonic()
                if now >= until or fleet.finishing.is_set():
                    if fleet.finishing.is_set():
                        await asyncio.sleep(self.rng.uniform(0, min(5.0, self.hb)))
                    await self.finish(job)
                    return
                if now >= acked + self.fence_after:
                    fleet.counts["self_fenced"] += 1
                    return
                if now >= next_beat:
                    sent = time.monotonic()
                    path = f"attempts/{job['attempt_id']}/heartbeat"
                    status, document = await fleet.call(
                        self.quick, "attempt_heartbeat", path, {"token": job["token"]}, max(1.0, self.hb)
                    )
                    if status == 200:
                        acked, next_beat = sent, sent + self.hb
                    elif status == 409:
                        return  # stale: counted from the outcome; the job is gone
                    else:  # as workers/runtime.py: a failed beat is retried soon
                        next_beat = time.monotonic() + min(1.0, self.hb / 2)
                wake = min(next_beat, until, acked + self.fence_after) - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fleet.finishing.wait(), max(0.0, wake))
        finally:
            fleet.held -= 1

    async def finish(self, job: dict) -> None:
        body = {"token": job["token"], "outcome": "succeeded", "summary": {"fleet_bench": True}, "error": None}
        for attempt in range(4):
            status, _ = await self.fleet.call(self.quick, "finish", f"attempts/{job['attempt_id']}/finish", body, 15)
            if status is not None and status < 500:
                return
            await asyncio.sleep(0.25 * 2**attempt * self.rng.uniform(0.5, 1.5))


async def sample_rss(cp: ControlPlane, pg_pid: int | None, peaks: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        before = time.monotonic()
        peaks["cp"] = max(peaks.get("cp", 0), tree_usage(cp.proc.pid)[1])
        if pg_pid:
            peaks["pg"] = max(peaks.get("pg", 0), tree_usage(pg_pid)[1])
        peaks["sample_s"] = max(peaks.get("sample_s", 0), time.monotonic() - before)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def loop_lag(lags: list[float], stalls: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """How late the event loop wakes a 100 ms sleep: the simulator's own delay in every latency.
    Stalls over 0.5 s are kept with their time, to tell the simulator's from the machine's."""
    while not stop.is_set():
        before = time.monotonic()
        await asyncio.sleep(0.1)
        lag = time.monotonic() - before - 0.1
        lags.append(lag)
        if lag > 0.5:
            stalls.append((before, lag))
            log(f"simulator event loop stalled {lag:.2f} s (process CPU so far {self_cpu():.1f} s)")


async def xact(helper: Helper, tag: str) -> dict:
    """pg_stat_database.xact_commit now ({"xact": None} on SQLite, or when the helper cannot answer)."""
    try:
        return await helper.call("XACT", tag, timeout=30)
    except (TimeoutError, RuntimeError) as exc:
        log(f"xact_commit sample {tag} failed: {exc!r}")
        return {"xact": None, "t": time.monotonic()}


async def simulate(args, cp: ControlPlane, pg_pid: int | None) -> dict:
    helper = Helper(cp)
    await helper.start()
    fleet = Fleet(args, cp, helper)
    workers = [SimWorker(fleet, n) for n in range(args.workers)]
    tasks: list[asyncio.Task] = []
    probes: set[asyncio.Task] = set()
    stop_sampling = asyncio.Event()
    peaks: dict[str, int] = {}
    sampler = asyncio.create_task(sample_rss(cp, pg_pid, peaks, stop_sampling))
    lags: list[float] = []
    stalls: list[tuple[float, float]] = []
    lagger = asyncio.create_task(loop_lag(lags, stalls, stop_sampling))
    try:
        log(f"enqueueing {args.busy} jobs for the busy workers")
        for n in range(args.busy):
            await helper.call("ENQ", f"busy-{n}")
        cpu0, sim0, helper0, pg0 = tree_usage(cp.proc.pid)[0], self_cpu(), helper.cpu(), tree_usage(pg_pid)[0]
        t_ramp = time.monotonic()
        log(f"starting {args.workers} workers over {args.ramp:g} s")
        for n, worker in enumerate(workers):
            tasks.append(asyncio.create_task(worker.run(args.ramp * n / max(1, args.workers))))
        await asyncio.sleep(args.ramp)
        settle_until = time.monotonic() + 60
        while fleet.held < args.busy and time.monotonic() < settle_until:
            await asyncio.sleep(0.5)
        t_steady, busy_at_steady = time.monotonic(), fleet.held
        log(
            f"steady state: {fleet.counts['registered']}/{args.workers} registered, {fleet.held}/{args.busy} busy"
            f" ({t_steady - t_ramp:.1f} s after the ramp began)"
        )
        quiet = min(args.quiet_window, args.duration)
        probing = max(0.0, args.duration - quiet - 5)
        t_quiet = t_steady + args.duration - quiet
        for k in range(args.pickup_probes):
            await asyncio.sleep(max(0.0, t_steady + probing * (k + 0.5) / args.pickup_probes - time.monotonic()))
            probes.add(asyncio.create_task(fleet.probe(k)))
        await asyncio.sleep(max(0.0, t_quiet - time.monotonic()))
        x0 = await xact(helper, "x0")
        await asyncio.sleep(max(0.0, t_steady + args.duration - time.monotonic()))
        t_end = time.monotonic()
        x1 = await xact(helper, "x1")
        log(f"steady state over ({fleet.held} busy); the busy workers finish")
        fleet.finishing.set()
        drain_until = time.monotonic() + 30
        while fleet.held and time.monotonic() < drain_until:
            await asyncio.sleep(0.2)
        t_done = time.monotonic()
        try:
            expired = (await helper.call("EXPIRED", "expired", timeout=120))["expired"]
        except (TimeoutError, RuntimeError):
            expired = None
        cpu1, sim1, helper1, pg1 = tree_usage(cp.proc.pid)[0], self_cpu(), helper.cpu(), tree_usage(pg_pid)[0]
    finally:
        for task in [*tasks, *probes]:
            task.cancel()
        await asyncio.gather(*tasks, *probes, return_exceptions=True)
        for worker in workers:
            worker.close()
        stop_sampling.set()
        await sampler
        await lagger
        await helper.stop()

    requests = sum(1 for kind in KINDS for sent in fleet.sent[kind] if t_ramp <= sent <= t_done)
    window = (t_quiet, t_end)
    wall = time.time() - time.monotonic()  # the control plane's log stamps wall-clock time

    def rate(kind: str) -> float:
        return sum(1 for sent in fleet.sent[kind] if window[0] <= sent < window[1]) / (window[1] - window[0])

    result: dict = {
        "registered": fleet.counts["registered"],
        "busy_at_steady": busy_at_steady,
        "settle_s": t_steady - t_ramp - args.ramp,
        "requests": requests,
        "wall_s": t_done - t_ramp,
        "claimed": fleet.counts["claimed"],
        "self_fenced": fleet.counts["self_fenced"],
        "expired": expired,
        "probes_sent": fleet.probes_sent,
        "probes_picked": len(fleet.pickups),
        "pickup_ms": [round(x * 1000, 2) for x in fleet.pickups],
        "cp_cpu_s": cpu1 - cpu0,
        "cp_cpu_per_1k": (cpu1 - cpu0) / requests * 1000 if requests else None,
        "cp_peak_rss_mib": peaks.get("cp", 0) / 2**20,
        "rss_sample_max_s": peaks.get("sample_s"),
        "pg_cpu_per_1k": (pg1 - pg0) / requests * 1000 if pg_pid and requests else None,
        "pg_peak_rss_mib": peaks.get("pg", 0) / 2**20 if pg_pid else None,
        "sim_cpu_s": sim1 - sim0,
        "loop_lag_p99_ms": pct(lags, 99) * 1000 if lags else None,
        "loop_lag_max_ms": max(lags) * 1000 if lags else None,
        "loop_stalls": [[round(at - t_ramp, 1), round(lag, 2)] for at, lag in stalls],
        "helper_cpu_s": helper1 - helper0,
        "quiet_s": window[1] - window[0],
        "quiet_wall": [window[0] + wall, window[1] + wall],
        "phases": {"steady": t_steady - t_ramp, "quiet": t_quiet - t_ramp, "end": t_end - t_ramp, "done": t_done - t_ramp},
        "quiet_claims_per_s": rate("claim"),
        "quiet_worker_hb_per_s": rate("worker_heartbeat"),
        "quiet_attempt_hb_per_s": rate("attempt_heartbeat"),
        "quiet_xact_per_s": (x1["xact"] - x0["xact"]) / (x1["t"] - x0["t"])
        if x0["xact"] is not None and x1["xact"] is not None
        else None,
        "calls": {},
    }
    outcomes: dict[str, int] = {}
    for kind in KINDS:
        entries = fleet.calls[kind]
        result["calls"][kind] = {
            "n": len(entries),
            "ms": sorted(round(took * 1000, 2) for _, took, _ in entries),
            # Raw: [seconds since the ramp began at sending, ms, outcome].
            "raw": [[round(sent - t_ramp, 3), round(took * 1000, 2), outcome] for sent, took, outcome in entries],
        }
        for _, _, outcome in entries:
            key = f"{kind} {outcome}"
            outcomes[key] = outcomes.get(key, 0) + 1
    result["outcomes"] = outcomes
    result["stale_live"] = sum(
        n for key, n in outcomes.items() if key.split()[0] in ("attempt_heartbeat", "finish") and "stale_attempt" in key
    )
    result["superseded"] = sum(n for key, n in outcomes.items() if "session_superseded" in key)
    result["other_4xx"] = sum(
        n for key, n in outcomes.items() if " 4xx:" in key and "stale_attempt" not in key and "session_superseded" not in key
    )
    result["5xx"] = sum(n for key, n in outcomes.items() if " 5xx:" in key)
    result["timeouts"] = sum(n for key, n in outcomes.items() if key.endswith(" timeout"))
    result["transport"] = sum(n for key, n in outcomes.items() if key.endswith(" transport"))
    result["claims_with_job"] = fleet.counts["claimed"]
    return result


# --------------------------------------------------------------------------- backends and runs


def one_run(args, backend: str, cluster, run: int) -> dict:
    processes = args.listener_processes or (2 if backend == "sqlite" else 4)
    root = tempfile.mkdtemp(prefix=f"apiary-fleet-{backend}-")
    database_url = cluster.create_database(f"apiary_fleet_{run}") if cluster else None
    pg_pid = postmaster_pid(cluster) if cluster else None
    cp = ControlPlane(root, args, backend=backend, database_url=database_url, processes=processes)
    try:
        if run == 1:
            cp.check()
        cp.start()
        log(f"[{backend} #{run}] control plane up on port {cp.port} (pid {cp.proc.pid}, {processes} listener processes)")
        result = asyncio.run(simulate(args, cp, pg_pid))
        result["processes"] = processes
        if cp.proc.poll() is not None:
            result["cp_exited"] = cp.proc.returncode
        scan = scan_log(cp.log_path, tuple(result["quiet_wall"]))
        result["cp_log"] = scan
        result["quiet_claim_tx_per_s"] = scan["claim_rounds_window"] / result["quiet_s"] if cp.counts_claims else None
        if scan["errors"]:
            log(f"[{backend} #{run}] control-plane log: {scan['errors']} error line(s), e.g. {scan['error_samples'][0]}")
        log(f"[{backend} #{run}] {summary_line(result)}")
        return result
    finally:
        cp.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", root], check=False)
        else:
            log(f"kept {root}")


def postmaster_pid(cluster) -> int | None:
    try:
        with open(cluster.data / "postmaster.pid") as f:
            return int(f.readline())
    except (OSError, ValueError):
        return None


def summary_line(r: dict) -> str:
    pick = pct(r["pickup_ms"], 50)
    return (
        f"{r['registered']} registered, {r['requests']} requests, pickup p50 {fmt_ms(pick)} ms"
        f" ({r['probes_picked']}/{r['probes_sent']}), stale {r['stale_live']}, timeouts {r['timeouts']},"
        f" 5xx {r['5xx']}, transport {r['transport']}, CP CPU {r['cp_cpu_s']:.1f} s, sim CPU {r['sim_cpu_s']:.1f} s"
    )


# --------------------------------------------------------------------------- table


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def fmt_ms(value) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def scalars(r: dict) -> dict[str, float | None]:
    """The table's numbers of one run, flat."""
    out: dict[str, float | None] = {}
    for kind in KINDS:
        ms = r["calls"][kind]["ms"]
        out[f"{kind}_n"] = r["calls"][kind]["n"]
        for p in (50, 99):
            out[f"{kind}_p{p}"] = pct(ms, p)
        out[f"{kind}_max"] = max(ms) if ms else None
    for p in (50, 99):
        out[f"pickup_p{p}"] = pct(r["pickup_ms"], p)
    out["pickup_max"] = max(r["pickup_ms"]) if r["pickup_ms"] else None
    for key in (
        "registered", "busy_at_steady", "claims_with_job", "probes_picked", "probes_sent", "stale_live", "expired", "self_fenced", "superseded",
        "other_4xx", "5xx", "timeouts", "transport", "requests", "cp_cpu_s", "cp_cpu_per_1k", "cp_peak_rss_mib",
        "pg_cpu_per_1k", "pg_peak_rss_mib", "sim_cpu_s", "helper_cpu_s", "loop_lag_p99_ms", "loop_lag_max_ms", "wall_s", "quiet_claims_per_s",
        "quiet_worker_hb_per_s", "quiet_attempt_hb_per_s", "quiet_xact_per_s", "processes", "quiet_claim_tx_per_s",
    ):
        out[key] = r.get(key)
    scan = r.get("cp_log") or {}
    out["cp_log_errors"] = scan.get("errors")
    out["cp_log_warnings"] = scan.get("warnings")
    out["cp_log_debug_other"] = scan.get("debug_other")
    out["claim_rounds_total"] = scan.get("claim_rounds_total") if r.get("quiet_claim_tx_per_s") is not None else None
    return out


def median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


ROWS = [
    ("listener processes (APIARY_HTTP_WORKERS)", lambda m: f"{m['processes']:.0f}"),
    ("workers registered / busy at steady state", lambda m: f"{m['registered']:,.0f} / {m['busy_at_steady']:,.0f}"),
    *[
        (
            f"{kind} ms p50 / p99 / max (n)",
            lambda m, k=kind: f"{fmt_ms(m[k + '_p50'])} / {fmt_ms(m[k + '_p99'])} / {fmt_ms(m[k + '_max'])} ({m[k + '_n']:,.0f})",
        )
        for kind in KINDS
    ],
    ("claims with a job", lambda m: f"{m['claims_with_job']:,.0f}"),
    (
        "pickup ms p50 / p99 / max (probes picked/sent)",
        lambda m: f"{fmt_ms(m['pickup_p50'])} / {fmt_ms(m['pickup_p99'])} / {fmt_ms(m['pickup_max'])}"
        f" ({m['probes_picked']:.0f}/{m['probes_sent']:.0f})",
    ),
    ("**stale answers to live workers** (must be 0)", lambda m: f"**{m['stale_live']:,.0f}**"),
    (
        "**leases expired under live workers** (must be 0)",
        lambda m: f"**{m['expired']:,.0f}**" if m["expired"] is not None else "—",
    ),
    ("self-fenced jobs / session_superseded", lambda m: f"{m['self_fenced']:,.0f} / {m['superseded']:,.0f}"),
    ("other 4xx / 5xx", lambda m: f"{m['other_4xx']:,.0f} / {m['5xx']:,.0f}"),
    ("timeouts / transport errors", lambda m: f"{m['timeouts']:,.0f} / {m['transport']:,.0f}"),
    ("requests sent (run wall time s)", lambda m: f"{m['requests']:,.0f} ({m['wall_s']:.0f})"),
    (
        "control plane CPU s / 1k requests (total s)",
        lambda m: f"{m['cp_cpu_per_1k']:.2f} ({m['cp_cpu_s']:.0f})" if m["cp_cpu_per_1k"] is not None else "—",
    ),
    ("control plane peak RSS MiB (sum over tree)", lambda m: f"{m['cp_peak_rss_mib']:,.0f}"),
    (
        "PostgreSQL server CPU s / 1k requests",
        lambda m: f"{m['pg_cpu_per_1k']:.2f}" if m["pg_cpu_per_1k"] is not None else "—",
    ),
    ("quiet window: claim requests/s sent", lambda m: f"{m['quiet_claims_per_s']:.1f}"),
    (
        "quiet window: worker / attempt heartbeats/s sent",
        lambda m: f"{m['quiet_worker_hb_per_s']:.1f} / {m['quiet_attempt_hb_per_s']:.1f}",
    ),
    (
        "quiet window: PostgreSQL xact_commit/s",
        lambda m: f"{m['quiet_xact_per_s']:,.0f}" if m["quiet_xact_per_s"] is not None else "—",
    ),
    (
        "**quiet window: claim transactions/s (server side)**",
        lambda m: f"**{m['quiet_claim_tx_per_s']:,.1f}**" if m["quiet_claim_tx_per_s"] is not None else "—",
    ),
    (
        "claim transactions, whole run (server side)",
        lambda m: f"{m['claim_rounds_total']:,.0f}" if m["claim_rounds_total"] is not None else "—",
    ),
    (
        "control-plane log: error / warning / other DEBUG lines",
        lambda m: f"{m['cp_log_errors']:,.0f} / {m['cp_log_warnings']:,.0f} / {m['cp_log_debug_other']:,.0f}"
        if m["cp_log_errors"] is not None
        else "—",
    ),
    (
        "simulator CPU s: fleet + enqueue helper (% of a core)",
        lambda m: f"{m['sim_cpu_s']:.1f} + {m['helper_cpu_s']:.1f} ({(m['sim_cpu_s'] + m['helper_cpu_s']) / m['wall_s']:.0%})",
    ),
    (
        "simulator event-loop lag ms p99 / max",
        lambda m: f"{fmt_ms(m['loop_lag_p99_ms'])} / {fmt_ms(m['loop_lag_max_ms'])}",
    ),
]

PER_RUN = [
    ("pickup p50 ms", "pickup_p50"), ("stale", "stale_live"), ("timeouts", "timeouts"),
    ("worker_heartbeat p99 ms", "worker_heartbeat_p99"), ("CP CPU s/1k", "cp_cpu_per_1k"),
    ("quiet claim tx/s", "quiet_claim_tx_per_s"),
    ("leases expired", "expired"), ("CP log errors", "cp_log_errors"),
]


def render(results: dict[str, list[dict] | str]) -> str:
    backends = list(results)
    medians = {}
    for backend, runs in results.items():
        if isinstance(runs, list):
            flat = [scalars(r) for r in runs]
            medians[backend] = {key: median([f[key] for f in flat]) for key in flat[0]}
    lines = ["| measurement | " + " | ".join(backends) + " |", "|---|" + "---:|" * len(backends)]
    for label, cell in ROWS:
        values = []
        for backend in backends:
            if backend not in medians:
                values.append("—")
                continue
            try:
                values.append(cell(medians[backend]))
            except (TypeError, ZeroDivisionError):
                values.append("—")
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    notes = []
    for backend, runs in results.items():
        if isinstance(runs, str):
            notes.append(f"{backend}: {runs}")
        elif len(runs) > 1:
            flat = [scalars(r) for r in runs]
            parts = []
            for label, key in PER_RUN:
                parts.append(f"{label} " + " / ".join(fmt_ms(f[key]) if f[key] is not None else "—" for f in flat))
            notes.append(f"per run, {backend}: " + "; ".join(parts))
        if isinstance(runs, list) and runs and all(r.get("quiet_claim_tx_per_s") is None for r in runs):
            notes.append(
                f"{backend}: claim transactions/s —: this control plane logs no line per claim transaction"
                " (or --no-count-claim-rounds); in the polling long-poll (before the notifier) each waiting"
                " long-poll ran a claim every ~0.3 s (0.3 s × uniform(0.7, 1.5)), about 1,650 claim tx/s"
                " measured for 500 idle workers in the issue"
            )
        for r in runs if isinstance(runs, list) else []:
            if r.get("cp_exited") is not None:
                notes.append(f"{backend}: the control plane exited ({r['cp_exited']}) during a run")
    return "\n".join(lines + ([""] + notes if notes else []))


def postgres_version() -> str:
    sys.path.insert(0, REPO)
    from tests.pgcluster import find_bindir, server_version

    bindir = find_bindir()
    return f"PostgreSQL {server_version(bindir)}" if bindir else "PostgreSQL absent"


def header(args, argv: list[str]) -> str:
    command = shlex.join(["python", "bench/fleet.py", *argv])
    tree = args.source_tree
    with contextlib.suppress(Exception):
        rev = subprocess.run(
            ["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=True
        ).stdout.strip()
        tree = f"{tree} at {rev}"
    return "\n".join(
        [
            f"`{command}`",
            "",
            f"{dt.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; {os.cpu_count()} CPUs (nproc), Python"
            f" {platform.python_version()}, SQLite {sqlite3.sqlite_version}, {postgres_version()}; control plane code:"
            f" {tree}",
            f"{args.workers} workers ({args.busy} busy), ramp {args.ramp:g} s, steady {args.duration:g} s"
            f" (quiet window {args.quiet_window:g} s), wait {args.wait:g} s, lease {args.lease:g} s,"
            f" heartbeat {args.heartbeat:g} s, hold {'until the end' if args.hold is None else f'{args.hold:g} s'},"
            f" {args.pickup_probes} pickup probes; "
            + (f"medians of {args.repeat} runs" if args.repeat > 1 else "1 run"),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="sqlite")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--busy", type=int, default=500, help="workers holding a job through the run")
    parser.add_argument("--duration", type=float, default=300, help="steady-state seconds (after the ramp)")
    parser.add_argument("--ramp", type=float, default=30, help="seconds over which the workers start")
    parser.add_argument("--wait", type=float, default=10, help="long-poll `wait` of every claim")
    parser.add_argument(
        "--hold", type=float, default=None,
        help="seconds a worker holds a job (default: the run); nothing replaces a finished job, so busy workers dwindle",
    )
    parser.add_argument("--lease", type=float, default=30, help="settings.queue.lease_duration, s")
    parser.add_argument("--heartbeat", type=float, default=10, help="settings.queue.heartbeat_interval, s")
    parser.add_argument("--worker-timeout", type=float, default=None, help="default 3 × heartbeat")
    parser.add_argument("--pickup-probes", type=int, default=10)
    parser.add_argument("--quiet-window", type=float, default=20)
    parser.add_argument("--listener-processes", type=int, default=None, help="default 2 on SQLite, 4 on PostgreSQL")
    parser.add_argument("--cp-env", action="append", default=[], metavar="KEY=VALUE", help="extra control-plane env")
    parser.add_argument("--source-tree", default=REPO, help="the checkout whose code the control plane runs")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the raw results to PATH")
    parser.add_argument("--keep", action="store_true", help="keep the temporary project (control plane log)")
    parser.add_argument(
        "--count-claim-rounds", action=argparse.BooleanOptionalAction, default=True,
        help="run the control plane with APIARY_LOG_LEVEL=DEBUG and count its claim-round lines in the quiet window",
    )
    args = parser.parse_args(argv)
    args.source_tree = os.path.abspath(args.source_tree)
    if args.busy > args.workers:
        parser.error("--busy cannot exceed --workers")

    def interrupted(signum, frame):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, interrupted)
    backends = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]
    results: dict[str, list[dict] | str] = {}
    for backend in backends:
        cluster = None
        try:
            if backend == "postgres":
                sys.path.insert(0, REPO)
                from tests.pgcluster import start_cluster

                try:
                    cluster = start_cluster()
                except RuntimeError as exc:
                    results[backend] = f"skipped: {exc}"
                    continue
            results[backend] = [one_run(args, backend, cluster, r + 1) for r in range(args.repeat)]
        except KeyboardInterrupt:
            log("interrupted: stopped every child process")
            return 130
        finally:
            if cluster:
                cluster.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "args": vars(args), "results": results}, f, indent=1)
    print(header(args, argv))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

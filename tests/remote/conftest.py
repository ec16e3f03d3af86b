"""Real processes on loopback: one control plane (`apiary run` serving the
worker protocol on a free port, `embedded_worker: false`) and `apiary worker`
processes, all using one canary worker token.

One control plane serves the whole module — starting one costs seconds on a
busy machine — and each test starts the workers it needs; they are gone when
the test ends. Jobs run one shell step that records where it ran in
`marks/` and, for the `*-hold` workflows, waits until the test creates
`gates/<task title>`, so a test decides when a job is "mid-run" and when it
may end. The tests read the control plane's SQLite file with plain sqlite3
(Django's connection belongs to pytest) and wait on conditions with
deadlines, never on fixed sleeps.

A test may build a control plane of its own: `ControlPlane(root,
edit_config=…, env=…)` changes the generated apiary.yaml (e.g. a longer lease)
and the environment of `apiary run` and its commands; with `DATABASE_URL` in
`env` the helpers read the queue from PostgreSQL (psycopg) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests import waiting
from workers import pgroups

from .proxy import Proxy

CANARY = "canary-remote-9f4e2b7c1d8a4e35b6c0"  # the worker token of every process in the module
LEASE = 3.0
HEARTBEAT = 0.5
WORKER_TIMEOUT = 2.0
WAIT = 60.0  # deadline for anything to happen; generous, the box is shared
TERMINAL = ("succeeded", "failed", "cancelled")

# Agents and what they require of a worker: (pool, labels, capabilities).
AGENTS: dict[str, tuple[str | None, tuple[str, ...], tuple[str, ...]]] = {
    "anyone": (None, (), ()),
    "alpha": ("alpha", (), ()),
    "beta": ("beta", (), ()),
    "docker": (None, ("linux",), ("docker",)),
    "gpu": (None, (), ("gpu",)),
    "sticky": (None, (), ()),  # workspace_affinity: true
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a worker process advertises (its command line)."""

    pool: str | None
    labels: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    capacity: int = 1

    def satisfies(self, workflow: str) -> bool:
        pool, labels, capabilities = AGENTS[workflow.rsplit("-", 1)[0]]
        return (pool is None or pool == self.pool) and set(labels) <= set(self.labels) and set(
            capabilities
        ) <= set(self.capabilities)


ALPHA = Spec(pool="alpha", labels=("linux", "fast"), capabilities=("docker",))
BETA = Spec(pool="beta", labels=("arm",), capabilities=("gpu",))

STEP = r"""
printf '%s %s %s %s\n' "$APIARY_WORKER_ID" "$APIARY_JOB_ID" "$APIARY_ATTEMPT" "$$" > "$MARKS/job$APIARY_JOB_ID.a$APIARY_ATTEMPT"
echo "started $APIARY_WORKFLOW attempt $APIARY_ATTEMPT"
if [ -n "$HOLD" ]; then
  while [ ! -e "$GATES/$APIARY_TASK_TITLE" ]; do sleep 0.05; done
fi
echo "ran $APIARY_WORKFLOW on $APIARY_WORKER_ID attempt $APIARY_ATTEMPT"
"""


# A workflow job's payload fields as columns; `->`/`->>` read JSON alike in SQLite (3.38+) and PostgreSQL.
PAYLOAD_COLUMNS = (
    "j.payload->>'workflow' AS workflow,"
    " CAST(j.payload->'task'->>'generation' AS INTEGER) AS generation,"
    " CAST(j.payload->'task'->>'id' AS INTEGER) AS task_id,"
    " CAST(j.payload->>'instance_id' AS INTEGER) AS instance_id"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project_config(*, listen: str | None, token: str | None, marks: Path, gates: Path) -> dict:
    env = {"MARKS": str(marks), "GATES": str(gates)}
    agents = []
    for name, (pool, labels, capabilities) in AGENTS.items():
        agent: dict[str, Any] = {"id": name, "runner": "shell", "command": "cat", "env": env}
        if pool:
            agent["worker_pool"] = pool
        if labels:
            agent["requires_labels"] = list(labels)
        if capabilities:
            agent["requires_capabilities"] = list(capabilities)
        if name == "sticky":
            agent["workspace_affinity"] = True
        agents.append(agent)
    workflows = []
    for name in AGENTS:
        for kind in ("quick", "hold"):
            step = {"id": "work", "run": STEP, "timeout": "120s"}
            if kind == "hold":
                step["env"] = {"HOLD": "1"}
            workflow = {"id": f"{name}-{kind}", "agent": name, "steps": [step]}
            if name == "sticky" and kind == "hold":
                workflow["priority"] = 10  # claimed before its quick sibling: it is the one that pins
            workflows.append(workflow)
    queue: dict[str, Any] = {
        "embedded_worker": False,
        "lease_duration": f"{LEASE}s",
        "heartbeat_interval": f"{HEARTBEAT}s",
        "worker_timeout": f"{WORKER_TIMEOUT}s",
    }
    if listen:
        queue["listen"] = listen
    if token:
        queue["worker_token"] = token
    return {
        "project": "remote",
        "settings": {"concurrency": 0, "queue": queue},
        "agents": agents,
        "workflows": workflows,
        "sources": [
            {
                "id": "inbox",
                "type": "directory",
                "path": "inbox",
                "pattern": "*.md",
                "poll_interval": "0.5s",
                "workflows": ["anyone-quick", "alpha-quick", "beta-quick", "docker-quick", "gpu-quick"],
            },
            {
                "id": "pinned",
                "type": "directory",
                "path": "pinned",
                "pattern": "*.md",
                "poll_interval": "0.5s",
                "redispatch_on_change": True,
                "workflows": ["sticky-hold", "sticky-quick"],
            },
        ],
    }


def dump_config(config: dict) -> str:
    """apiary.yaml text; no YAML anchors (apiary refuses them), so shared objects are written out in full."""
    return yaml.safe_dump(json.loads(json.dumps(config)), sort_keys=False)


def command(*args: str) -> list[str]:
    """`apiary ARGS…` through the console script's own router, with the
    interpreter running the tests (no reliance on PATH)."""
    # -P: the working directory (a worker's folder) must not shadow the project's packages.
    return [sys.executable, "-P", "-c", "from apiary_site.cli import main; main()", *args]


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment without APIARY_*/DJANGO_*/DATABASE_URL: each process
    finds its state beside its own config file."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_")) and k != "DATABASE_URL"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def utc(text: str | dt.datetime | None) -> dt.datetime | None:
    """A datetime column as SQLite holds it (UTC text); PostgreSQL's come as aware datetimes already."""
    if text is None or isinstance(text, dt.datetime):
        return text
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


def wait_for(
    predicate: Callable[[], Any], *, what: str, timeout: float = WAIT, alive: tuple = (), context: Callable[[], str] = str
) -> Any:
    """`tests.waiting.wait_for` for these processes: poll until `predicate()`
    is truthy (returned). Fails after `timeout`, or at once when a process in
    `alive` exits meanwhile, with `context()` (e.g. a log tail) appended. A
    database not created yet, or busy, counts as "not yet"."""

    def condition() -> Any:
        try:
            value = predicate()
        except sqlite3.OperationalError:  # not created yet, or busy: not yet
            value = None
        if not value:
            for proc in alive:
                if proc.poll() is not None:
                    raise AssertionError(f"{proc} exited ({proc.poll()}) while waiting for {what}\n{context()}")
        return value

    return waiting.wait_for(condition, timeout=timeout, what=what, step=0.05, on_timeout=context)


def pid_running(pid: int) -> bool:
    """A live, non-zombie process (zombies of orphaned steps may never be reaped in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


class ControlPlane:
    """`apiary run` in the background, plus helpers to run the operations
    commands against the same config and to read its database."""

    def __init__(self, root: Path, *, edit_config: Callable[[dict], None] | None = None,
                 env: dict[str, str] | None = None):
        """`edit_config` changes the generated config in place before it is
        written; `env` is added to the environment of `apiary run` and of
        every `cli()` command (not of worker processes)."""
        self.root = root
        self.env = dict(env or {})
        self.database_url = self.env.get("DATABASE_URL")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.marks, self.gates = root / "marks", root / "gates"
        for folder in (self.marks, self.gates, root / "inbox", root / "pinned", root / "elsewhere"):
            folder.mkdir(parents=True, exist_ok=True)
        self.config = root / "apiary.yaml"
        config = project_config(listen=f"127.0.0.1:{self.port}", token=CANARY, marks=self.marks, gates=self.gates)
        if edit_config:
            edit_config(config)
        self.config.write_text(dump_config(config))
        self.db_path = root / ".apiary" / "apiary.db"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.transcript: list[str] = []  # every command's output, for the canary scan
        self.titles: set[str] = set()

    def __str__(self) -> str:
        return f"control plane (pid {self.proc.pid if self.proc else '-'})"

    # ------------------------------------------------------------- process

    def start(self) -> None:
        self.starts += 1
        log = open(self.root / f"controlplane-{self.starts}.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            command("run", "--config", str(self.config)),
            cwd=self.root,
            env=clean_env(**self.env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self.serving, what="the control plane to serve GET status", alive=(self.proc,), context=self.tail)

    def serving(self) -> bool:
        try:
            answer = requests.get(self.api("status"), headers=self.auth(), timeout=2)
        except requests.RequestException:
            return False
        return answer.status_code == 200

    def port_closed(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) != 0

    def kill(self) -> None:
        """SIGKILL the daemon; its listener child notices and stops too."""
        self.proc.kill()
        self.proc.wait(timeout=10)
        wait_for(self.port_closed, what="the orphaned listener to stop serving", context=self.tail)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        with contextlib.suppress(AssertionError):
            wait_for(self.port_closed, what="the listener to stop", timeout=15)
        return self.proc.returncode

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.root.glob("controlplane-*.log")))

    def tail(self, lines: int = 30) -> str:
        return "--- control plane output (tail) ---\n" + "\n".join(self.output().splitlines()[-lines:])

    # ------------------------------------------------------------- protocol

    def api(self, path: str) -> str:
        return f"{self.url}/api/worker/v1/{path}"

    @staticmethod
    def auth(token: str = CANARY) -> dict:
        return {"Authorization": f"Bearer {token}"}

    # ------------------------------------------------------------- commands

    def cli(self, *args: str, env: dict | None = None, cwd: Path | None = None, config: bool = True,
            check: bool = True) -> subprocess.CompletedProcess:
        argv = command(*args, *(("--config", str(self.config)) if config else ()))
        result = subprocess.run(
            argv, cwd=cwd or self.root, env=clean_env(**{**self.env, **(env or {})}), capture_output=True, text=True,
            timeout=120, check=False,
        )
        self.transcript += [result.stdout, result.stderr]
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def add_task(self, title: str, *workflows: str) -> int:
        """`apiary task add`; returns the task id."""
        self.titles.add(title)
        flags = [arg for w in workflows for arg in ("--workflow", w)]
        out = self.cli("task", "add", "--source", "manual", "--title", title, *flags).stdout
        return int(re.match(r"task (\d+) ", out).group(1))

    def drop_file(self, source: str, name: str, title: str, body: str = "") -> None:
        """Write (or rewrite) an item of a directory source, atomically."""
        self.titles.add(title)
        temp = self.root / source / f".{name}.tmp"
        temp.write_text(f"# {title}\n\n{body}\n")
        os.replace(temp, self.root / source / name)

    def status(self, *, remote: bool = False) -> dict:
        if remote:
            result = self.cli("status", "--json", "--control-plane", self.url, "--token", CANARY, config=False,
                              cwd=self.root / "elsewhere")
        else:
            result = self.cli("status", "--json")
        return json.loads(result.stdout)

    def cancel(self, instance_id: int) -> None:
        self.cli("cancel", str(instance_id))

    # ------------------------------------------------------------- gates and marks

    def open_gate(self, title: str) -> None:
        (self.gates / title).touch()

    def started(self, job_id: int, attempt: int) -> dict | None:
        """Where attempt N of a job ran its step: {"worker", "pid"}, once it started."""
        path = self.marks / f"job{job_id}.a{attempt}"
        try:
            worker, _, _, pid = path.read_text().split()
        except (OSError, ValueError):
            return None
        return {"worker": worker, "pid": int(pid)}

    # ------------------------------------------------------------- database

    def rows(self, statement: str, *params: Any) -> list[sqlite3.Row]:
        if self.database_url:
            return self._pg_rows(statement, *params)
        if not self.db_path.exists():
            raise sqlite3.OperationalError("no database yet")
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=10)) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(statement, params).fetchall()

    def _pg_rows(self, statement: str, *params: Any) -> list[dict]:
        """The same statements on PostgreSQL: `?` placeholders become `%s`; rows are dicts."""
        import psycopg  # only the PostgreSQL tests need it
        from psycopg.rows import dict_row

        with psycopg.connect(self.database_url, row_factory=dict_row, connect_timeout=10) as conn:
            if not params:  # no parameters: psycopg leaves a literal % alone
                return conn.execute(statement).fetchall()
            return conn.execute(statement.replace("%", "%%").replace("?", "%s"), params).fetchall()

    def value(self, statement: str, *params: Any) -> Any:
        rows = self.rows(statement, *params)
        if not rows:
            return None
        return next(iter(rows[0].values())) if isinstance(rows[0], dict) else rows[0][0]

    def jobs(self, title: str) -> list[sqlite3.Row]:
        """The jobs of a task. Workflow, generation, task and instance are read from
        the job's payload (workflows/payload.py); the instance row that points at the
        job (`workflows_workflowinstance.job_id`) must say the same."""
        rows = self.rows(
            f"SELECT j.id, j.state, {PAYLOAD_COLUMNS}, j.summary, j.reason, j.cancel_requested_at,"
            " i.id AS row_instance_id, i.task_id AS row_task_id, i.workflow AS row_workflow,"
            " i.generation AS row_generation"
            " FROM queue_job j JOIN workflows_task t ON t.id = CAST(j.payload->'task'->>'id' AS INTEGER)"
            " LEFT JOIN workflows_workflowinstance i ON i.job_id = j.id"
            " WHERE t.title = ? ORDER BY j.id",
            title,
        )
        for row in rows:
            payload = (row["instance_id"], row["task_id"], row["workflow"], row["generation"])
            instance = (row["row_instance_id"], row["row_task_id"], row["row_workflow"], row["row_generation"])
            assert payload == instance, f"job {row['id']}: payload {payload} but instance row {instance}"
        return rows

    def job(self, title: str, workflow: str, generation: int = 1) -> sqlite3.Row | None:
        return next((j for j in self.jobs(title) if j["workflow"] == workflow and j["generation"] == generation), None)

    def attempts(self, job_id: int) -> list[sqlite3.Row]:
        return self.rows(
            "SELECT id, number, worker_id, state, claimed_at, lease_expires_at, last_heartbeat_at, finished_at,"
            " error, job_state FROM queue_attempt WHERE job_id = ? ORDER BY number",
            job_id,
        )

    def events(self, job_id: int, kind: str | None = None) -> list[sqlite3.Row]:
        rows = self.rows("SELECT kind, at, worker_id, attempt_id, detail FROM queue_jobevent WHERE job_id = ? ORDER BY id",
                         job_id)
        return [r for r in rows if kind is None or r["kind"] == kind]

    def worker_row(self, worker_id: str) -> sqlite3.Row | None:
        rows = self.rows("SELECT * FROM queue_worker WHERE worker_id = ?", worker_id)
        return rows[0] if rows else None

    def all_done(self, *titles: str, count: int | None = None) -> list[sqlite3.Row] | None:
        """Every job of these tasks, once all are terminal (and there are `count` of them)."""
        jobs = [j for t in titles for j in self.jobs(t)]
        if not jobs or (count is not None and len(jobs) != count):
            return None
        return jobs if all(j["state"] in TERMINAL for j in jobs) else None

    def able_workers(self) -> list[str]:
        """Workers that could claim now, judged as status does (healthy, ready, not draining)."""
        now = dt.datetime.now(dt.UTC)
        return [
            w["worker_id"]
            for w in self.rows("SELECT * FROM queue_worker")
            if w["ready"] and not w["draining"] and not w["drain_requested"]
            and (now - utc(w["last_heartbeat_at"])).total_seconds() <= WORKER_TIMEOUT
        ]


class WorkerProcess:
    """One `apiary worker` process with its own folder (config copy and `.apiary/`)."""

    def __init__(self, cp: ControlPlane, worker_id: str, spec: Spec, *, url: str | None = None,
                 token_from_env: bool = False, token: str = CANARY):
        self.cp, self.worker_id, self.spec = cp, worker_id, spec
        self.directory = cp.root / "hosts" / worker_id
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "apiary.yaml"
        config.write_text(cp.config.read_text())
        argv = ["worker", "--control-plane", url or cp.url, "--id", worker_id, "--capacity", str(spec.capacity),
                "--config", str(config), "--claim-wait", "0.5", "--grace", "0.5"]
        if spec.pool:
            argv += ["--pool", spec.pool]
        argv += [arg for label in spec.labels for arg in ("--label", label)]
        argv += [arg for cap in spec.capabilities for arg in ("--capability", cap)]
        env = {}
        if token_from_env:
            env["APIARY_WORKER_TOKEN"] = token
        else:
            argv += ["--token", token]
        self.log_path = self.directory / f"worker-{time.monotonic_ns()}.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            command(*argv), cwd=self.directory, env=clean_env(**env), stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def __str__(self) -> str:
        return f"worker {self.worker_id} (pid {self.proc.pid})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def registered(self) -> bool:
        return bool(self.cp.value("SELECT 1 FROM queue_worker WHERE worker_id = ? AND pid = ?", self.worker_id,
                                  self.pid))

    def wait_registered(self) -> WorkerProcess:
        wait_for(self.registered, what=f"{self} to register", alive=(self.proc,), context=self.tail)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def credential(self) -> str:
        """The credential its enrolment gave it, as it keeps it in its state directory
        (after the control plane's URL: workers/credentials.py)."""
        return (self.directory / ".apiary" / "workers" / f"{self.worker_id}.credential").read_text().split()[1]

    def tail(self, lines: int = 30) -> str:
        return f"--- {self} output (tail) ---\n" + "\n".join(self.output().splitlines()[-lines:])

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = WAIT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self} did not exit within {timeout:g}s\n{self.tail()}") from None

    def runner_groups(self) -> list[int]:
        return sorted(pgroups.recorded(self.directory / ".apiary" / "run" / self.worker_id))

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pgid in self.runner_groups():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


class Workers:
    """Per-test factory of worker processes; all of them are gone after the test."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self.started: list[WorkerProcess] = []
        self.proxies: list[Proxy] = []

    def start(self, *specs: tuple[str, Spec], via: dict[str, Proxy] | None = None,
              token_from_env: tuple[str, ...] = (), token: str = CANARY) -> list[WorkerProcess]:
        """Start the workers side by side, then wait until each has registered."""
        procs = []
        for worker_id, spec in specs:
            proxy = (via or {}).get(worker_id)
            procs.append(WorkerProcess(self.cp, worker_id, spec, url=proxy.url if proxy else None,
                                       token_from_env=worker_id in token_from_env, token=token))
        self.started += procs
        for proc in procs:
            proc.wait_registered()
        return procs

    def proxy(self) -> Proxy:
        proxy = Proxy(self.cp.port)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for worker in self.started:
            worker.cleanup()
        for proxy in self.proxies:
            proxy.close()


@pytest.fixture(scope="module")
def canary_record() -> dict:
    """What the canary test scans: output of commands and proxies' exchanges."""
    return {"proxies": []}


@pytest.fixture(scope="module")
def cp(tmp_path_factory, canary_record):
    plane = ControlPlane(tmp_path_factory.mktemp("remote"))
    plane.start()
    canary_record["cp"] = plane
    yield plane
    plane.stop()


@pytest.fixture
def workers(cp, canary_record):
    factory = Workers(cp)
    yield factory
    factory.close()
    canary_record["proxies"] += factory.proxies
    # Let nothing of this test leak into the next one: open every gate and
    # cancel what did not end (only after a failure is there anything).
    for title in cp.titles:
        cp.open_gate(title)
    if cp.proc.poll() is None:
        leftover = cp.rows(
            f"SELECT {PAYLOAD_COLUMNS} FROM queue_job j WHERE j.state IN ('queued', 'leased')"
        )
        for row in leftover:
            cp.cli("cancel", str(row["instance_id"]), check=False)

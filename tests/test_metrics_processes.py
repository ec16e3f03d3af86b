"""/metrics and /healthz from real processes: `apiary run` with a listener of
two gunicorn processes and its own monitoring address (settings.metrics.listen).

Heartbeats sent over fresh connections are handled by both listener
processes (their metric files show it), yet every scrape — from either
listener process, or from the daemon's own address — answers the same
numbers: the queue is read from the database, the heartbeat histogram is
merged from every process's file. In local mode (no listener) the daemon's
address serves the embedded worker's heartbeats, and a token, when set, is
required there too."""

import json
import socket
from pathlib import Path

import pytest
import requests
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import Daemon, Database, wait_for

pytestmark = pytest.mark.processes

TOKEN = "canary-metrics-processes-worker-7e3a9b1c5d"
SCRAPE_TOKEN = "canary-metrics-processes-scrape-2f8d4c6a0b"
WAIT = 60.0
MAX_HEARTBEATS = 400  # sent until both listener processes have handled some


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh(method: str, url: str, **kwargs) -> requests.Response:
    """One request on a connection of its own, so the kernel may hand it to either listener process."""
    with requests.Session() as session:
        return session.request(method, url, headers={"Connection": "close", **kwargs.pop("headers", {})}, timeout=30, **kwargs)


def samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def heartbeats_per_file(directory: Path) -> dict[str, float]:
    counts = {}
    for path in directory.glob("histogram_*.db"):
        for metric in MultiProcessCollector.merge([str(path)]):
            for s in metric.samples:
                if s.name == "apiary_attempt_heartbeat_seconds_count":
                    counts[path.name] = s.value
    return counts


def project(root: Path, settings: str, tasks: int, step: str = "true") -> Path:
    root.mkdir()
    (root / "tasks").mkdir()
    for n in range(tasks):
        (root / "tasks" / f"t{n}.md").write_text(f"# task {n}\n")
    config = root / "apiary.yaml"
    config.write_text(
        "project: multi\n"
        f"settings:\n{settings}"
        "agents: [{id: sh, runner: shell, command: cat}]\n"
        f"workflows: [{{id: w, agent: sh, steps: [{{id: s, run: {json.dumps(step)}}}]}}]\n"
        "sources: [{id: inbox, type: directory, path: tasks, pattern: '*.md', poll_interval: 1s, workflows: [w]}]\n"
    )
    return config


def healthy(url: str) -> bool:
    try:
        return fresh("GET", f"{url}/healthz").status_code == 200
    except requests.ConnectionError:
        return False


def test_every_listener_process_and_the_daemon_answer_the_same(tmp_path):
    listen, monitor = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = project(
        tmp_path / "p",
        f"  queue:\n    listen: '{listen}'\n    worker_token: {TOKEN}\n    embedded_worker: false\n"
        "    lease_duration: 120s\n    heartbeat_interval: 10s\n    worker_timeout: 120s\n"
        "    listener: {processes: 2}\n"
        f"  metrics: {{listen: '{monitor}'}}\n",
        tasks=3,
    )
    base, api = f"http://{listen}", f"http://{listen}/api/worker/v1"
    db = Database(config.parent / ".apiary" / "apiary.db")
    daemon = Daemon(config)
    try:
        wait_for(lambda: healthy(base), timeout=WAIT, what="the listener's /healthz", daemon=daemon)
        wait_for(lambda: db.value("SELECT count(*) FROM queue_job") == 3, timeout=WAIT, what="3 jobs", daemon=daemon)
        enrolled = fresh("POST", f"{api}/workers/register", headers={"Authorization": f"Bearer {TOKEN}"}, json={
            "worker_id": "w1", "pool": None, "labels": [], "capacity": 1, "version": "t", "hostname": "h", "pid": 1,
            "capabilities": ["apiary.workflow", "apiary.hooks", "apiary.effects", "runner:shell"],
        })  # fmt: skip
        assert enrolled.status_code == 200, enrolled.text
        auth = {"Authorization": f"Bearer {enrolled.json()['credential']}"}
        claimed = fresh("POST", f"{api}/claims", headers=auth, json={"worker_id": "w1", "session": enrolled.json()["session"], "max_jobs": 1, "wait": 0})
        (job,) = claimed.json()["jobs"]

        metrics_dir = config.parent / ".apiary" / "metrics"
        sent = 0
        while sent < MAX_HEARTBEATS and len([n for n in heartbeats_per_file(metrics_dir).values() if n]) < 2:
            beat = fresh("POST", f"{api}/attempts/{job['attempt_id']}/heartbeat", headers=auth, json={"token": job["token"]})
            assert beat.status_code == 200, beat.text
            sent += 1
        per_process = heartbeats_per_file(metrics_dir)
        assert len([n for n in per_process.values() if n]) == 2, f"one process handled all {sent} heartbeats: {per_process}"
        assert sum(per_process.values()) == sent

        answers = [fresh("GET", f"{base}/metrics") for _ in range(12)] + [fresh("GET", f"http://{monitor}/metrics") for _ in range(3)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        seen = [samples(a.text) for a in answers]
        for scrape in seen:
            assert scrape[("apiary_attempt_heartbeat_seconds_count", ())] == sent
            assert scrape[("apiary_jobs", (("pool", ""), ("project", "multi"), ("state", "queued")))] == 2
            assert scrape[("apiary_jobs", (("pool", ""), ("project", "multi"), ("state", "leased")))] == 1
            assert scrape[("apiary_claims_total", ())] == 1
            assert scrape[("apiary_worker_active_jobs", (("worker", "w1"),))] == 1
        assert fresh("GET", f"http://{monitor}/healthz").json()["status"] == "ok"
    finally:
        daemon.stop()


def test_local_mode_serves_the_embedded_workers_heartbeats_to_token_holders(tmp_path):
    monitor = f"127.0.0.1:{free_port()}"
    gate = tmp_path / "gate"
    config = project(
        tmp_path / "p",
        "  queue: {lease_duration: 6s, heartbeat_interval: 0.2s, worker_timeout: 10s}\n"
        f"  metrics: {{listen: '{monitor}', token: {SCRAPE_TOKEN}}}\n",
        tasks=1,
        step=f"while [ ! -e {gate} ]; do sleep 0.05; done",
    )
    url = f"http://{monitor}"
    daemon = Daemon(config)
    try:
        wait_for(lambda: healthy(url), timeout=WAIT, what="the daemon's /healthz", daemon=daemon)
        assert fresh("GET", f"{url}/metrics").status_code == 401
        assert fresh("GET", f"{url}/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert fresh("GET", f"{url}/admin/").status_code == 404  # nothing but the two answers here

        def beats() -> float:
            got = fresh("GET", f"{url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"})
            assert got.status_code == 200, got.text
            return samples(got.text)[("apiary_attempt_heartbeat_seconds_count", ())]

        wait_for(lambda: beats() >= 2, timeout=WAIT, what="the embedded worker's heartbeats in /metrics", daemon=daemon)
        gate.touch()
        daemon.send(15)
        assert daemon.wait(WAIT) == 0
    finally:
        gate.touch()
        daemon.stop()
    with pytest.raises(requests.ConnectionError):
        fresh("GET", f"{url}/healthz")

"""A fleet of idle long-polling workers must not starve the busy ones (issue item 6).

More idle workers wait in `POST claims` (`wait: 30`) than the listener once
had threads (gunicorn gthread, 2 processes × 16 threads = 32), while a few
real `apiary worker` processes run held jobs on a short lease (3 s, attempt
heartbeats every 0.5 s). The guarantee: a waiting claim holds nothing the
busy workers need, so every attempt heartbeat is answered, no attempt of a
live worker expires, no worker fences itself, and every job runs once and
succeeds.

The idle workers are threads of this test process speaking the real
protocol over real sockets with `requests`, each registered under its own
id in a pool that no job needs and with no capabilities (no `runner:…`), so
no job is ever theirs and their claims always wait the full 30 s.
They register before the busy workers start and begin waiting once the held
jobs run. Why 96, three times the old thread count: which listener process
accepts a connection is the kernel's choice and was uneven (53/17 of 70
connections was typical with 64 waiters), so with 40 or 64 waiters one
process sometimes kept free threads and the busy workers whose connections
landed there were served — the test passed on the gthread listener in 1 of
5 (40) and 1 of 12 (64) runs. With 96 every process had more than 32 waiters.
The held jobs end only once every busy attempt's lease has been renewed for
two lease durations after all idle claims were sent (read from the queue's
attempts table): a condition waited for with a deadline, not a sleep.

Runs on the backend of the run: SQLite, or PostgreSQL with
APIARY_TEST_DB=postgres (a database in the session's throwaway cluster).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import signal
import threading
import time

import pytest
import requests

from tests import pg, waiting

from .conftest import ALPHA, CANARY, LEASE, ControlPlane, Workers, utc, wait_for

pytestmark = pytest.mark.processes

IDLE_WORKERS = 96  # three times the 32 threads of the gthread listener (2 processes × 16)
IDLE_WAIT = 30.0  # the protocol's longest long-poll
BUSY_WORKERS = 3
IDLE_POOL = "fleet-idle"  # no agent names this pool (and idle workers advertise no runner): claims wait
BUSY_WORKFLOW = "alpha-hold"  # pool alpha: only the busy workers can take it
WINDOW = 2 * LEASE  # how long every busy lease must be kept alive with the fleet waiting

# What a worker logs when an attempt heartbeat went unanswered (its read
# timeout is one heartbeat interval, at least 1 s), when it fenced itself, or
# when the control plane called its attempt stale (workers/runtime.py).
TROUBLE = re.compile(r"heartbeat of attempt \d+ failed|self-fenced|stale|discard")


class IdleWorker(threading.Thread):
    """One idle worker: register, then (once `go` is set) long-poll `POST claims` until told to stop."""

    def __init__(self, cp: ControlPlane, worker_id: str, go: threading.Event, stop: threading.Event):
        super().__init__(name=worker_id, daemon=True)
        self.cp, self.worker_id, self.go, self.stop = cp, worker_id, go, stop
        self.registered = threading.Event()
        self.first_claim_sent = threading.Event()
        self.claims: list[dict] = []  # {"sent", "answered", "status", "jobs"} per answered claim
        self.errors: list[str] = []

    def run(self) -> None:
        session = requests.Session()
        session.headers.update(ControlPlane.auth(CANARY))
        try:
            answer = session.post(self.cp.api("workers/register"), timeout=(5, 30), json={
                "worker_id": self.worker_id, "pool": IDLE_POOL, "labels": [], "capabilities": [], "capacity": 1,
                "version": "fleet-test", "hostname": "fleet-test", "pid": os.getpid(),
            })
            if answer.status_code != 200:
                self.errors.append(f"register: HTTP {answer.status_code} {answer.text[:200]}")
                return
            token = answer.json()["session"]
            session.headers.update(ControlPlane.auth(answer.json()["credential"]))  # its own, from now on
            self.registered.set()
            self.go.wait()
            while not self.stop.is_set():
                sent = time.monotonic()
                self.first_claim_sent.set()
                answer = session.post(self.cp.api("claims"), timeout=(5, IDLE_WAIT + 30), json={
                    "worker_id": self.worker_id, "session": token, "max_jobs": 1, "wait": IDLE_WAIT,
                })
                jobs = answer.json().get("jobs") if answer.status_code == 200 else None
                self.claims.append({"sent": sent, "answered": time.monotonic(), "status": answer.status_code,
                                    "jobs": jobs})
                if answer.status_code != 200 or jobs:
                    self.errors.append(f"claim: HTTP {answer.status_code} {answer.text[:200]}")
                    return
        except requests.RequestException as exc:
            if not self.stop.is_set():  # at the end the control plane is killed under the waiting claims
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            session.close()

    def waited_through(self, since: float, until: float) -> bool:
        """Its claims were outstanding from `since` to `until` (none answered in between)."""
        return not any(since < c["answered"] < until for c in self.claims)


@pytest.fixture
def database_env(request) -> dict[str, str]:
    """The control plane's environment for the run's backend."""
    if not pg.postgres_requested():
        return {}
    cluster = request.getfixturevalue("apiary_pg_cluster")
    return {"DATABASE_URL": cluster.create_database(f"apiary_fleet_{os.getpid()}_{time.monotonic_ns() % 10**9}")}


@pytest.fixture
def fleet(tmp_path, database_env):
    cp = ControlPlane(tmp_path / "fleet", env=database_env)
    workers = Workers(cp)
    go, stop = threading.Event(), threading.Event()
    idle: list[IdleWorker] = []
    try:
        yield cp, workers, go, stop, idle
    finally:
        stop.set()
        go.set()
        workers.close()
        for title in cp.titles:
            cp.open_gate(title)
        if cp.proc is not None and cp.proc.poll() is None:
            # The whole group at once (daemon, listener, its workers): a graceful
            # stop would wait out the idle claims still in flight.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cp.proc.pid, signal.SIGKILL)
            cp.proc.wait(timeout=10)
        for waiter in idle:
            waiter.join(timeout=10)


def test_idle_long_polling_fleet_does_not_starve_busy_workers_heartbeats(fleet):
    cp, workers, go, stop, idle = fleet
    started = time.monotonic()
    cp.start()
    # The idle fleet registers first: 96 registrations are writes, kept out of the window that counts.
    idle += [IdleWorker(cp, f"fleet-idle-{i:02}", go, stop) for i in range(1, IDLE_WORKERS + 1)]
    for waiter in idle:
        waiter.start()

    def fleet_errors() -> str:
        return "\n".join(f"{w.worker_id}: {e}" for w in idle for e in w.errors)

    wait_for(lambda: all(w.registered.is_set() for w in idle) or fleet_errors(),
             what=f"{IDLE_WORKERS} idle workers to register", alive=(cp.proc,), context=cp.tail)
    assert not fleet_errors(), fleet_errors()
    busy = workers.start(*((f"fleet-busy-{i}", ALPHA) for i in range(1, BUSY_WORKERS + 1)))
    titles = [f"fleet-{i}" for i in range(1, BUSY_WORKERS + 1)]
    for title in titles:
        cp.add_task(title, BUSY_WORKFLOW)

    def held_jobs():
        """The held jobs, once each one's step runs and its attempt has an acknowledged heartbeat."""
        jobs = [cp.job(t, BUSY_WORKFLOW) for t in titles]
        if not all(jobs):
            return None
        for job in jobs:
            attempts = cp.attempts(job["id"])
            if not (attempts and cp.started(job["id"], 1) and attempts[0]["last_heartbeat_at"]):
                return None
        return jobs

    alive = tuple(w.proc for w in busy) + (cp.proc,)
    jobs = wait_for(held_jobs, what=f"{BUSY_WORKERS} held jobs to run", alive=alive, context=cp.tail)
    job_ids = [j["id"] for j in jobs]

    def trouble() -> str:
        """What broke the guarantee: an attempt expired (or a second one), a busy worker's trouble line."""
        found = []
        for job_id in job_ids:
            for a in cp.attempts(job_id):
                if a["state"] not in ("active", "succeeded") or a["number"] != 1:
                    found.append(f"job {job_id}: attempt {a['number']} of worker {a['worker_id']} is {a['state']}"
                                 f" (last heartbeat {a['last_heartbeat_at']}, lease until {a['lease_expires_at']})")
        for worker in busy:
            found += [f"{worker.worker_id} (alive: {worker.proc.poll() is None}) logged: {line}"
                      for line in worker.output().splitlines() if TROUBLE.search(line)]
        return "\n".join(found)

    def no_trouble() -> None:
        problem = trouble()
        if problem:
            # Let the trouble play out (fencing, expiry) for a bounded while, so the failure tells all of it.
            with contextlib.suppress(AssertionError):
                waiting.wait_for(lambda: not any(cp.attempts(j)[-1]["state"] == "active" for j in job_ids),
                                 timeout=2 * LEASE, step=0.1)
            problem = trouble()
            raise AssertionError(
                f"with {IDLE_WORKERS} idle workers long-polling, the busy workers' leases were not kept "
                f"({time.monotonic() - fleet_waiting[0]:.1f}s after the fleet started waiting):\n{problem}\n"
                f"{cp.tail(10)}"
            )

    fleet_waiting = [time.monotonic()]
    assert not trouble(), f"trouble before the idle fleet started:\n{trouble()}"

    # The idle fleet goes waiting: every one sends a claim that no job can answer.
    go.set()
    wait_for(lambda: all(w.first_claim_sent.is_set() for w in idle) or fleet_errors(),
             what=f"{IDLE_WORKERS} idle workers to send a claim", alive=alive, context=cp.tail)
    assert not fleet_errors(), fleet_errors()
    saturated_at = fleet_waiting[0] = time.monotonic()
    window_end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=WINDOW)

    def renewed_through_window():
        no_trouble()
        attempts = [cp.attempts(job_id)[0] for job_id in job_ids]
        return all(utc(a["last_heartbeat_at"]) >= window_end for a in attempts)

    wait_for(renewed_through_window, what=f"every busy lease to be renewed for {WINDOW:g}s with the fleet waiting",
             alive=alive, context=cp.tail)
    window_closed = time.monotonic()
    assert not fleet_errors(), fleet_errors()
    lapsed = [w.worker_id for w in idle if not w.waited_through(saturated_at, window_closed)]
    assert not lapsed, f"idle claims answered before their wait ran out, so the fleet was not waiting: {lapsed}"

    for title in titles:
        cp.open_gate(title)
    done = wait_for(lambda: cp.all_done(*titles, count=BUSY_WORKERS) or no_trouble(),
                    what="the held jobs to end", alive=alive, context=cp.tail)

    busy_ids = {w.worker_id for w in busy}
    for job in done:
        attempts = cp.attempts(job["id"])
        assert job["state"] == "succeeded", (dict(job), [dict(a) for a in attempts])
        assert [(a["number"], a["state"]) for a in attempts] == [(1, "succeeded")], [dict(a) for a in attempts]
        assert attempts[0]["worker_id"] in busy_ids
    expired = cp.rows("SELECT id, job_id, worker_id FROM queue_attempt WHERE state = 'expired'")
    assert not expired, [dict(a) for a in expired]
    assert not trouble(), trouble()
    assert all(w.proc.poll() is None for w in busy), "a busy worker exited"
    assert not fleet_errors(), fleet_errors()
    print(f"\n{IDLE_WORKERS} idle long-polling workers, {BUSY_WORKERS} busy: every lease renewed through "
          f"{WINDOW:g}s, {BUSY_WORKERS} jobs succeeded on their first attempt ({time.monotonic() - started:.1f}s)")

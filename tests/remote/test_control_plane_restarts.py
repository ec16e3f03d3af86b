"""The control plane restarted under a running job, and the control plane on
PostgreSQL behind several gunicorn processes — real processes on loopback.

Each test builds a control plane of its own (conftest's `ControlPlane` with
an edited config): the restart test needs a lease long enough to outlive a
restart, the PostgreSQL test a database URL and a project limit. Neither
uses the module-wide `cp` of test_remote_workers.py.
"""

import contextlib
import dataclasses
import datetime as dt
import os
import re
import time
from pathlib import Path

import pytest

from tests import pg, pgcluster

from .conftest import ALPHA, BETA, ControlPlane, Workers, pid_running, utc, wait_for

pytestmark = pytest.mark.processes


# --------------------------------------------------------------------------- processes, from /proc


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (scanning /proc: no psutil, no ps)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == pid and state not in "ZX":
            found.append(int(stat.parent.name))
    return found


def listener_pid(cp: ControlPlane) -> int | None:
    """The gunicorn arbiter `apiary run` started (`python -m apiary_site.listener`)."""
    for pid in children(cp.proc.pid):
        with contextlib.suppress(OSError):
            if b"apiary_site.listener" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def established_on(port: int) -> set[int]:
    """Socket inodes of established TCP connections whose *local* port is
    `port`: the server side of connections the listener accepted (a client's
    side has the port as its remote end)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def sockets_of(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def serving_pids(pids: list[int], port: int) -> set[int]:
    """Which of `pids` hold an accepted connection on `port` right now."""
    accepted = established_on(port)
    return {pid for pid in pids if sockets_of(pid) & accepted}


def running_attempt(cp: ControlPlane, title: str, workflow: str):
    """The job's first attempt once its step runs (its mark is written)."""
    job = cp.job(title, workflow)
    if job and cp.started(job["id"], 1):
        attempts = cp.attempts(job["id"])
        return attempts[0] if attempts else None
    return None


@contextlib.contextmanager
def own_control_plane(cp: ControlPlane):
    """Workers for `cp`; afterwards every worker, gate and the control plane are gone."""
    workers = Workers(cp)
    try:
        yield workers
    finally:
        workers.close()
        for title in cp.titles:
            cp.open_gate(title)
        if cp.proc is not None:
            cp.stop()


# --------------------------------------------------------------------------- a restart shorter than the lease

RESTART_LEASE = 12.0
RESTART_HEARTBEAT = 0.5
RESTART_WORKER_TIMEOUT = 6.0
FENCE_MARGIN = min(2.0, RESTART_LEASE * 0.1)  # the runtime's default margin (workers/runtime.py)


@pytest.fixture
def restart_plane(tmp_path):
    def longer_lease(config: dict) -> None:
        config["settings"]["queue"].update(
            lease_duration=f"{RESTART_LEASE:g}s",
            heartbeat_interval=f"{RESTART_HEARTBEAT:g}s",
            worker_timeout=f"{RESTART_WORKER_TIMEOUT:g}s",
        )

    cp = ControlPlane(tmp_path / "restart", edit_config=longer_lease)
    with own_control_plane(cp) as workers:
        yield cp, workers


def test_control_plane_restart_shorter_than_the_lease_costs_no_running_job(restart_plane):
    cp, workers = restart_plane
    cp.start()
    (worker,) = workers.start(("steady", ALPHA))
    cp.add_task("steady-1", "anyone-hold")
    attempt = wait_for(lambda: running_attempt(cp, "steady-1", "anyone-hold"), what="the job to run",
                       alive=(worker.proc,), context=worker.tail)
    job_id, attempt_id = cp.jobs("steady-1")[0]["id"], attempt["id"]
    # Mid-job, with the lease renewed at least once by a heartbeat.
    before = wait_for(lambda: (a := cp.attempts(job_id)[0])["last_heartbeat_at"] and a, what="an attempt heartbeat")
    runner = cp.started(job_id, 1)["pid"]
    listener = listener_pid(cp)
    assert listener, f"no listener child of {cp}"

    killed_wall = dt.datetime.now(dt.UTC)
    killed = time.monotonic()
    cp.kill()  # returns once the port is closed: the orphaned listener noticed and stopped
    wait_for(lambda: not pid_running(listener), what="the listener child to exit", timeout=15)
    port_closed = time.monotonic() - killed
    cp.start()  # the same config: same port, same state directory
    serving = time.monotonic() - killed

    def acknowledged_again():
        row = cp.attempts(job_id)[0]
        beat = utc(row["last_heartbeat_at"])
        # Nothing acknowledged anything while the control plane was dead.
        return row if beat > killed_wall and utc(row["lease_expires_at"]) > utc(before["lease_expires_at"]) else None

    after = wait_for(acknowledged_again, what="the worker's heartbeat to be acknowledged after the restart",
                     alive=(worker.proc, cp.proc), context=lambda: worker.tail() + "\n" + cp.tail())
    outage = time.monotonic() - killed
    fenced_at = RESTART_LEASE - FENCE_MARGIN
    print(
        f"\ncontrol-plane restart: {outage:.2f}s from SIGKILL until the running attempt's heartbeat was acknowledged "
        f"again (port closed after {port_closed:.2f}s, serving again after {serving:.2f}s); "
        f"lease_duration {RESTART_LEASE:g}s, the worker would self-fence after {fenced_at:g}s without an ack "
        f"({outage / RESTART_LEASE:.0%} of the lease used)"
    )
    # The worker did notice the outage: its heartbeats failed while the control plane was down.
    assert re.search(rf"heartbeat of attempt {attempt_id} failed", worker.output()), worker.tail()
    assert after["state"] == "active" and pid_running(runner), (dict(after), f"outage {outage:.2f}s")

    cp.open_gate("steady-1")
    done = wait_for(lambda: cp.all_done("steady-1"), what="the job to end", alive=(worker.proc,),
                    context=worker.tail)[0]
    context = f"outage {outage:.2f}s vs lease {RESTART_LEASE:g}s\n{worker.tail()}"
    assert done["state"] == "succeeded", context
    # Exactly one attempt, the one that ran through the restart: no re-run, no expiry.
    assert [(a["id"], a["state"], a["worker_id"]) for a in cp.attempts(job_id)] == [
        (attempt_id, "succeeded", "steady")
    ], context
    assert cp.started(job_id, 2) is None, context
    assert [e["kind"] for e in cp.events(job_id) if e["kind"] in ("claimed", "expired", "finished")] == [
        "claimed", "finished"
    ], context
    # The control plane commits before its answer reaches the worker, which logs it after.
    finished = f"finish: job {job_id} attempt {attempt_id} outcome succeeded → job succeeded"
    log = wait_for(lambda: finished in worker.output() and worker.output(), what="the worker to log the acknowledged finish",
                   context=lambda: context)
    assert "discard" not in log.lower() and "self-fenced" not in log, context
    assert worker.proc.poll() is None


# --------------------------------------------------------------------------- PostgreSQL behind several gunicorns

HTTP_WORKERS = 3
PROJECT_LIMIT = 3
TASKS = 40
MISSING = (
    "PostgreSQL server binaries not found (looked at $APIARY_PG_BINDIR or pg_config --bindir, "
    "/usr/lib/postgresql/*/bin, PATH); install the postgresql package to run this test "
    "(APIARY_REQUIRE_POSTGRES=1 makes this a failure)"
)
# Each job holds its slot briefly, so the limit has something to bite on.
BRIEF_STEP = 'sleep 0.4\necho "ran on $APIARY_WORKER_ID"'


@pytest.fixture
def pg_database_url(request) -> str:
    """A fresh database: in the session's cluster when the run uses
    APIARY_TEST_DB=postgres, else in a throwaway cluster of this test's own."""
    if pgcluster.find_bindir() is None:
        if pg.postgres_required():
            pytest.fail(f"APIARY_REQUIRE_POSTGRES=1: {MISSING}")
        pytest.skip(MISSING)
    own = None
    if pg.postgres_requested():
        cluster = request.getfixturevalue("apiary_pg_cluster")
    else:
        cluster = own = pgcluster.start_cluster()
    try:
        yield cluster.create_database(f"apiary_gunicorn_{os.getpid()}_{time.monotonic_ns() % 10**9}")
    finally:
        if own:
            own.stop()


@pytest.fixture
def pg_plane(pg_database_url, tmp_path):
    def limited(config: dict) -> None:
        config["settings"]["concurrency"] = PROJECT_LIMIT  # the project limit
        # Expiry is not what this test is about: a lease the busy box cannot miss.
        config["settings"]["queue"].update(lease_duration="10s", heartbeat_interval="0.5s", worker_timeout="5s")
        config["workflows"].append(
            {"id": "anyone-brief", "agent": "anyone", "steps": [{"id": "work", "run": BRIEF_STEP, "timeout": "60s"}]}
        )
        config["sources"].append(
            {"id": "bulk", "type": "directory", "path": "bulk", "pattern": "*.md", "poll_interval": "0.5s",
             "workflows": ["anyone-brief"]}
        )

    root = tmp_path / "pg"
    (root / "bulk").mkdir(parents=True)
    cp = ControlPlane(root, edit_config=limited,
                      env={"DATABASE_URL": pg_database_url, "APIARY_HTTP_WORKERS": str(HTTP_WORKERS)})
    with own_control_plane(cp) as workers:
        yield cp, workers


def bulk_jobs(cp: ControlPlane) -> list[dict]:
    return cp.rows(
        "SELECT j.id, j.state FROM queue_job j"
        " JOIN workflows_task t ON t.id = CAST(j.payload->'task'->>'id' AS INTEGER)"  # the task is in the payload
        " WHERE t.title LIKE 'bulk-%' ORDER BY j.id"
    )


def peak_leased(cp: ControlPlane) -> int:
    """Most attempts of the project leased at once, walking the job events in
    id order: a claim counts in, its attempt's finish or expiry counts out. A
    claim sees a slot free only after the finish that freed it committed, so
    the event ids respect that order (the timestamps, taken before each
    transaction, need not)."""
    active, peak = set(), 0
    for event in cp.rows("SELECT kind, attempt_id FROM queue_jobevent ORDER BY id"):
        if event["kind"] == "claimed":
            active.add(event["attempt_id"])
            peak = max(peak, len(active))
        elif event["kind"] in ("finished", "expired"):
            active.discard(event["attempt_id"])
    return peak


def test_postgres_control_plane_behind_several_gunicorn_workers(pg_plane):
    cp, workers = pg_plane
    started = time.monotonic()
    cp.start()
    arbiter = listener_pid(cp)
    assert arbiter, f"no listener child of {cp}"
    gunicorns = wait_for(lambda: (kids := children(arbiter)) and len(kids) == HTTP_WORKERS and kids,
                         what=f"{HTTP_WORKERS} gunicorn worker processes", alive=(cp.proc,), context=cp.tail)
    assert not cp.db_path.exists(), "the control plane made a SQLite database despite DATABASE_URL"
    up = time.monotonic() - started

    two = [("pg-alpha", dataclasses.replace(ALPHA, capacity=2)), ("pg-beta", dataclasses.replace(BETA, capacity=2))]
    procs = workers.start(*two)
    for i in range(TASKS):
        cp.drop_file("bulk", f"task-{i:02}.md", f"bulk-{i:02}")
    run_from = time.monotonic()

    served: set[int] = set()

    def all_ended():
        served.update(serving_pids(gunicorns, cp.port))  # sampled while the workers talk to the listener
        jobs = bulk_jobs(cp)
        return jobs if len(jobs) == TASKS and all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs) \
            else None

    jobs = wait_for(all_ended, what=f"{TASKS} jobs to end", alive=(cp.proc, *(w.proc for w in procs)),
                    context=cp.tail)
    ran = time.monotonic() - run_from

    attempts = {j["id"]: cp.attempts(j["id"]) for j in jobs}
    for job in jobs:
        assert job["state"] == "succeeded", (dict(job), [dict(a) for a in attempts[job["id"]]])
        assert [a["state"] for a in attempts[job["id"]]].count("succeeded") == 1, [dict(a) for a in attempts[job["id"]]]
    peak = peak_leased(cp)
    assert peak <= PROJECT_LIMIT, f"{peak} jobs of the project were leased at once (limit {PROJECT_LIMIT})"
    assert peak == PROJECT_LIMIT, f"the workload never reached the limit (peak {peak}): it tested nothing"
    by_worker = {w.worker_id: sum(a["worker_id"] == w.worker_id for rows in attempts.values() for a in rows)
                 for w in procs}
    # Which gunicorn process accepts a connection is the kernel's choice; with a
    # handful of keep-alive connections all may land on one, so how many served
    # is reported below, not asserted. The listener really runs HTTP_WORKERS.
    assert served and all(pid in gunicorns for pid in served)

    cp_code = cp.stop()
    print(
        f"\nPostgreSQL control plane, {HTTP_WORKERS} gunicorn workers: {TASKS} jobs in {ran:.1f}s "
        f"(control plane up in {up:.1f}s); attempts per worker {by_worker}; peak leased {peak} "
        f"(project limit {PROJECT_LIMIT}); gunicorn processes that served: {len(served)} of {len(gunicorns)}; "
        f"apiary run exited {cp_code}"
    )
    assert cp_code == 0, cp.tail()

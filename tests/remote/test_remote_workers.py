"""Remote workers end to end: a control plane and `apiary worker` processes on
loopback, killed, stopped, cut off and drained for real (issue 4, item 6).

Fixtures (conftest): `cp` is the module's control plane, `workers` starts
worker processes for one test. ALPHA workers are pool alpha, labels
linux+fast, capability docker; BETA workers are pool beta, label arm,
capability gpu. Workflow `<agent>-quick` runs at once, `<agent>-hold` waits
for its gate (`cp.open_gate(title)`).
"""

import datetime as dt
import json
import re
import signal
import sqlite3
import subprocess
import time

import pytest
import requests

from .conftest import (
    ALPHA,
    BETA,
    CANARY,
    HEARTBEAT,
    LEASE,
    ControlPlane,
    clean_env,
    command,
    dump_config,
    free_port,
    pid_running,
    project_config,
    utc,
    wait_for,
)

pytestmark = pytest.mark.processes


def succeeded(cp: ControlPlane, job_id: int) -> list:
    return [a for a in cp.attempts(job_id) if a["state"] == "succeeded"]


def attempt_running(cp: ControlPlane, job_id: int, number: int = 1):
    """The attempt's row once its step is running (its mark is written)."""
    attempts = cp.attempts(job_id)
    if len(attempts) >= number and cp.started(job_id, number):
        return attempts[number - 1]
    return None


def leased_job(cp: ControlPlane, title: str, workflow: str):
    job = cp.job(title, workflow)
    return job if job and attempt_running(cp, job["id"]) else None


# --------------------------------------------------------------------------- status without workers


def test_status_warns_when_no_healthy_worker_can_take_queued_jobs(cp, workers):
    # No worker process runs in this test; earlier tests' workers are gone (stale or drained).
    wait_for(lambda: not cp.able_workers(), what="no registered worker to be able to claim")
    task = cp.add_task("unserved-1", "anyone-quick")
    job = cp.jobs("unserved-1")[0]

    text = cp.cli("status").stdout
    assert "WARNING" in text and "no healthy, ready, non-draining worker" in text, text
    doc = cp.status()
    assert doc["jobs"]["queued"] >= 1
    assert any(b["job_id"] == job["id"] for b in doc["blocked"]), doc["blocked"]

    cp.cancel(job["instance_id"])
    assert cp.jobs("unserved-1")[0]["state"] == "cancelled", task


# --------------------------------------------------------------------------- routing and affinity


def test_mixed_workload_lands_on_satisfying_workers_and_affinity_pins(cp, workers):
    a, b = workers.start(("route-alpha", ALPHA), ("route-beta", BETA))
    specs = {a.worker_id: a.spec, b.worker_id: b.spec}

    # A mixed workload, from a directory source and from `apiary task add`.
    cp.drop_file("inbox", "route-1.md", "route-1")
    cp.drop_file("inbox", "route-2.md", "route-2")
    cp.add_task("route-3", "anyone-quick", "docker-quick", "gpu-quick", "alpha-quick", "beta-quick", "sticky-quick")
    jobs = wait_for(lambda: cp.all_done("route-1", "route-2", "route-3", count=16), what="16 jobs to end",
                    alive=(a.proc, b.proc), context=cp.tail)
    used = set()
    for job in jobs:
        assert job["state"] == "succeeded", dict(job)
        assert len(succeeded(cp, job["id"])) == 1
        for attempt in cp.attempts(job["id"]):
            worker = attempt["worker_id"]
            assert specs[worker].satisfies(job["workflow"]), f"{job['workflow']} ran on {worker}"
            used.add(worker)
    assert used == set(specs)  # pool-bound jobs forced both to work

    # Affinity: the first claim of the pinned task's `sticky-hold` pins the task.
    cp.drop_file("pinned", "stick.md", "stick-1", "first version")
    first = wait_for(lambda: leased_job(cp, "stick-1", "sticky-hold"), what="sticky-hold to run")
    owner = cp.attempts(first["id"])[0]["worker_id"]
    other = next(w for w in specs if w != owner)
    later = wait_for(lambda: cp.job("stick-1", "sticky-quick"), what="sticky-quick to be enqueued")
    # A younger job nobody is pinned to goes to the idle worker; the older
    # pinned job, which the idle worker would have claimed first, waits.
    cp.add_task("free-1", "anyone-quick")
    free = wait_for(lambda: cp.all_done("free-1"), what="free-1 to end")[0]
    assert [a["worker_id"] for a in cp.attempts(free["id"])] == [other]
    assert cp.attempts(later["id"]) == [] and cp.job("stick-1", "sticky-quick")["state"] == "queued"
    blocked = {b["job_id"]: b["reason"] for b in cp.status()["blocked"]}
    assert blocked[later["id"]].startswith(f"pinned to worker {owner}"), blocked
    cp.open_gate("stick-1")
    wait_for(lambda: cp.all_done("stick-1"), what="generation 1 of the pinned task to end")
    assert {a["worker_id"] for j in cp.jobs("stick-1") for a in cp.attempts(j["id"])} == {owner}

    # A later generation is pinned too, until the pin is released.
    busy_workflow = "alpha-hold" if specs[owner] == ALPHA else "beta-hold"
    cp.add_task("busy-1", busy_workflow)
    wait_for(lambda: leased_job(cp, "busy-1", busy_workflow), what="the owner to be busy")
    cp.drop_file("pinned", "stick.md", "stick-1", "second version")
    wait_for(lambda: len([j for j in cp.jobs("stick-1") if j["generation"] == 2]) == 2, what="generation 2")
    cp.add_task("free-2", "anyone-quick")
    free = wait_for(lambda: cp.all_done("free-2"), what="free-2 to end")[0]
    assert [a["worker_id"] for a in cp.attempts(free["id"])] == [other]
    gen2 = [j for j in cp.jobs("stick-1") if j["generation"] == 2]
    assert all(j["state"] == "queued" and not cp.attempts(j["id"]) for j in gen2)

    task_id = gen2[0]["task_id"]
    out = cp.cli("affinity", "release", str(task_id)).stdout
    assert f"released its pin to worker {owner}" in out
    wait_for(lambda: all(j["state"] == "succeeded" for j in cp.jobs("stick-1")), what="generation 2 to end",
             alive=(a.proc, b.proc))
    for job in cp.jobs("stick-1"):
        if job["generation"] == 2:
            assert [a["worker_id"] for a in cp.attempts(job["id"])] == [other]
    cp.open_gate("busy-1")
    busy = wait_for(lambda: cp.all_done("busy-1"), what="busy-1 to end")[0]
    assert busy["state"] == "succeeded" and succeeded(cp, busy["id"])[0]["worker_id"] == owner


# --------------------------------------------------------------------------- a killed worker


def test_killed_worker_job_runs_again_elsewhere_once_the_lease_runs_out(cp, workers, record_property):
    procs = {w.worker_id: w for w in workers.start(("kill-alpha", ALPHA), ("kill-beta", BETA))}
    cp.add_task("kill-1", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "kill-1", "anyone-hold"), what="the job to run")
    # Mid-job: its step runs and the control plane has acknowledged a heartbeat.
    wait_for(lambda: cp.attempts(job["id"])[0]["last_heartbeat_at"], what="an attempt heartbeat")
    victim = procs[cp.attempts(job["id"])[0]["worker_id"]]
    survivor = next(w for w in procs.values() if w is not victim)

    killed_at = dt.datetime.now(dt.UTC)
    victim.proc.kill()
    victim.proc.wait(timeout=10)
    second = wait_for(lambda: attempt_running(cp, job["id"], 2), what="a second attempt", alive=(survivor.proc,),
                      context=cp.tail)
    first = cp.attempts(job["id"])[0]
    assert first["state"] == "expired" and second["worker_id"] == survivor.worker_id

    # The killed worker is stale (local and remote status) while the job runs again.
    for doc in (cp.status(), cp.status(remote=True)):
        health = {w["worker_id"]: w["health"] for w in doc["workers"]}
        assert health[victim.worker_id] == "stale" and health[survivor.worker_id] == "healthy", health

    cp.open_gate("kill-1")
    done = wait_for(lambda: cp.all_done("kill-1"), what="the job to end", alive=(survivor.proc,))[0]
    assert done["state"] == "succeeded"
    assert [a["worker_id"] for a in succeeded(cp, job["id"])] == [survivor.worker_id]
    assert len(cp.events(job["id"], "finished")) == 1
    assert json.loads(done["summary"])["worker_id"] == survivor.worker_id

    reclaim = (utc(second["claimed_at"]) - killed_at).total_seconds()
    lease_left = (utc(first["lease_expires_at"]) - killed_at).total_seconds()
    record_property("reclaim_seconds", round(reclaim, 2))
    print(
        f"\nreclaim after SIGKILL: {reclaim:.2f}s from the kill to the other worker's claim "
        f"(lease_duration {LEASE:g}s; {lease_left:.2f}s of the lease were left at the kill; "
        f"reaper every 1s, claim long-poll 0.5s)"
    )


# --------------------------------------------------------------------------- a stopped (stale) worker


def test_stopped_worker_is_fenced_and_its_result_discarded(cp, workers):
    proxies = {"stop-alpha": workers.proxy(), "stop-beta": workers.proxy()}
    procs = {w.worker_id: w for w in workers.start(("stop-alpha", ALPHA), ("stop-beta", BETA), via=proxies)}
    cp.add_task("stop-1", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "stop-1", "anyone-hold"), what="the job to run")
    stale = procs[cp.attempts(job["id"])[0]["worker_id"]]
    fresh = next(w for w in procs.values() if w is not stale)
    proxy = proxies[stale.worker_id]
    first_id = cp.attempts(job["id"])[0]["id"]
    claim = next(
        j for e in proxy.matching(r"POST .*/claims$") if e.status == 200 for j in e.answer()["jobs"]
        if j["attempt_id"] == first_id
    )

    stale.send(signal.SIGSTOP)
    try:
        second = wait_for(lambda: attempt_running(cp, job["id"], 2), what="the other worker to take the job",
                          alive=(fresh.proc,), context=cp.tail)
        assert second["worker_id"] == fresh.worker_id
        cp.open_gate("stop-1")  # both steps may end now; the stale worker is still stopped
        wait_for(lambda: cp.all_done("stop-1"), what="the new attempt to finish", alive=(fresh.proc,))
        resumed_at = time.time()
    finally:
        stale.send(signal.SIGCONT)

    # The stale worker notices on its own: its self-fence or a 409 discards the result.
    discarded = re.compile(rf"job {job['id']} attempt {first_id} result discarded|"
                           rf"finish of job {job['id']} attempt {first_id} refused as stale")
    wait_for(lambda: discarded.search(stale.output()), what="the stale worker to discard its result",
             alive=(stale.proc,), context=stale.tail)
    after = [e for e in proxy.matching(rf"/attempts/{first_id}/") if e.at >= resumed_at]
    for exchange in after:  # whatever it still sent about that attempt was refused
        assert exchange.status == 409 and exchange.answer()["error"]["code"] == "stale_attempt", exchange
    print(f"\nstale worker after SIGCONT sent {[e.path.rsplit('/', 1)[1] for e in after]} for attempt {first_id} "
          "(409 each); with none, its self-fence discarded the result before it could send")

    # The control plane refuses the stale attempt's heartbeat and finish alike, and changes nothing.
    before = ([dict(r) for r in cp.jobs("stop-1")], [dict(r) for r in cp.attempts(job["id"])])
    for path, body in (("heartbeat", {"token": claim["token"]}),
                       ("finish", {"token": claim["token"], "outcome": "failed", "summary": {}, "error": "late"})):
        answer = requests.post(cp.api(f"attempts/{first_id}/{path}"), json=body, headers=cp.auth(stale.credential()),
                               timeout=10)
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "stale_attempt", answer.text
    assert ([dict(r) for r in cp.jobs("stop-1")], [dict(r) for r in cp.attempts(job["id"])]) == before

    done = cp.jobs("stop-1")[0]
    assert done["state"] == "succeeded"
    assert [(a["number"], a["state"]) for a in cp.attempts(job["id"])] == [(1, "expired"), (2, "succeeded")]
    summary = json.loads(done["summary"])
    assert (summary["worker_id"], summary["attempt"]) == (fresh.worker_id, 2)
    assert len(cp.events(job["id"], "finished")) == 1


def test_cut_off_worker_stops_its_runner_before_another_worker_starts_the_job(cp, workers):
    """Self-fencing across a partition: every request of the cut-off worker
    hangs (the proxy holds them), so it hears nothing — not even an error.
    Its runner must be gone before the other worker's runner starts."""
    proxies = {"cut-alpha": workers.proxy(), "cut-beta": workers.proxy()}
    procs = {w.worker_id: w for w in workers.start(("cut-alpha", ALPHA), ("cut-beta", BETA), via=proxies)}
    cp.add_task("cut-1", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "cut-1", "anyone-hold"), what="the job to run")
    wait_for(lambda: cp.attempts(job["id"])[0]["last_heartbeat_at"], what="an attempt heartbeat")
    cut = procs[cp.attempts(job["id"])[0]["worker_id"]]
    other = next(w for w in procs.values() if w is not cut)
    runner = cp.started(job["id"], 1)["pid"]

    proxies[cut.worker_id].hold(".")  # from now on nothing of `cut` reaches the control plane
    try:
        second = wait_for(lambda: cp.started(job["id"], 2), what="the other worker to start the job",
                          alive=(other.proc, cut.proc), context=cut.tail)
        overlap = pid_running(runner)
        assert second["worker"] == other.worker_id
        assert not overlap, f"{cut} still ran attempt 1 when {other.worker_id} started attempt 2\n{cut.tail()}"
        assert "(self-fenced)" in cut.output()
    finally:
        proxies[cut.worker_id].release()
    cp.open_gate("cut-1")
    done = wait_for(lambda: cp.all_done("cut-1"), what="the job to end", alive=(other.proc,))[0]
    assert done["state"] == "succeeded"
    assert [a["worker_id"] for a in succeeded(cp, job["id"])] == [other.worker_id]


# --------------------------------------------------------------------------- a lost finish reply


def test_lost_finish_reply_is_resent_and_the_job_finishes_once(cp, workers):
    proxy = workers.proxy()
    proxy.drop_reply_once(r"POST .*/attempts/\d+/finish$")
    (worker,) = workers.start(("lossy", ALPHA), via={"lossy": proxy})
    cp.add_task("lossy-1", "anyone-quick")
    # The first finish reached the control plane (the job may have ended
    # already); the worker, without an answer, sends it again.
    finishes = wait_for(lambda: len(proxy.matching(r"/finish$")) >= 2 and proxy.matching(r"/finish$"),
                        what="the finish to be sent again", alive=(worker.proc,), context=worker.tail)
    wait_for(lambda: "→ job succeeded" in worker.output(), what="the worker to log the acknowledged finish")
    job = cp.all_done("lossy-1")[0]
    assert len(proxy.matching(r"/finish$")) == 2
    lost, resent = finishes
    assert lost.dropped and not resent.dropped
    assert lost.status == resent.status == 200 and lost.answer() == resent.answer() == {"job_state": "succeeded"}
    assert lost.json() == resent.json() and lost.path == resent.path
    assert job["state"] == "succeeded"
    assert [(a["state"], a["job_state"]) for a in cp.attempts(job["id"])] == [("succeeded", "succeeded")]
    assert len(cp.events(job["id"], "finished")) == 1
    assert re.search(rf"finish: job {job['id']} attempt \d+ outcome succeeded → job succeeded", worker.output())


# --------------------------------------------------------------------------- the control plane dies


def test_control_plane_killed_and_restarted_loses_no_job_and_finishes_none_twice(cp, workers):
    a, b = workers.start(("crash-alpha", ALPHA), ("crash-beta", BETA))
    cp.add_task("crash-1", "alpha-hold")
    cp.add_task("crash-2", "beta-hold")
    cp.add_task("crash-3", "anyone-quick", "docker-quick", "gpu-quick", "sticky-quick")
    wait_for(lambda: leased_job(cp, "crash-1", "alpha-hold") and leased_job(cp, "crash-2", "beta-hold"),
             what="both held jobs to run", alive=(a.proc, b.proc))

    killed_at = time.time()
    cp.kill()
    cp.open_gate("crash-1")  # the steps end while the control plane is down
    cp.open_gate("crash-2")
    cp.start()
    serving_again = time.time()
    restarted = dt.datetime.now(dt.UTC)

    jobs = wait_for(lambda: cp.all_done("crash-1", "crash-2", "crash-3", count=6), what="every job to end",
                    alive=(a.proc, b.proc), context=cp.tail)
    for job in jobs:
        assert job["state"] == "succeeded", dict(job)
        assert len(succeeded(cp, job["id"])) == 1, [dict(r) for r in cp.attempts(job["id"])]
        finished = [json.loads(e["detail"]) for e in cp.events(job["id"], "finished")]
        assert [f["outcome"] for f in finished if f["job_state"] == "succeeded"] == ["succeeded"]
    # The workers reconnected on their own: alive, heartbeating, and claiming after the restart.
    for worker in (a, b):
        assert worker.proc.poll() is None
        wait_for(lambda w=worker: utc(cp.worker_row(w.worker_id)["last_heartbeat_at"]) > restarted,
                 what=f"{worker} to heartbeat again")
    claimed_after = [at for j in jobs for at in [utc(x["claimed_at"]) for x in cp.attempts(j["id"])] if at > restarted]
    assert claimed_after, "no claim after the restart"
    print(f"\ncontrol plane: {serving_again - killed_at:.1f}s from SIGKILL to serving again (lease {LEASE:g}s); "
          f"attempts per job: {[len(cp.attempts(j['id'])) for j in jobs]}")


# --------------------------------------------------------------------------- cancel


def test_cancel_while_leased_stops_the_runner_and_a_racing_finish_ends_cancelled(cp, workers):
    proxy = workers.proxy()
    (worker,) = workers.start(("canceller", BETA), via={"canceller": proxy})

    # A running job: the next heartbeat answers cancel and the runner stops.
    cp.add_task("cancel-1", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "cancel-1", "anyone-hold"), what="the job to run")
    runner = cp.started(job["id"], 1)["pid"]
    cp.cancel(job["instance_id"])
    done = wait_for(lambda: cp.all_done("cancel-1"), what="the cancel to end the job", alive=(worker.proc,))[0]
    wait_for(lambda: not pid_running(runner), what="the runner to stop", timeout=10)
    assert done["state"] == "cancelled"
    (attempt,) = cp.attempts(job["id"])
    assert (attempt["state"], attempt["job_state"]) == ("cancelled", "cancelled")  # the worker's finish, not expiry
    assert f"cancel requested: job {job['id']} attempt {attempt['id']}" in worker.output()
    requested = utc(cp.events(job["id"], "cancel_requested")[0]["at"])
    stopped_after = (utc(attempt["finished_at"]) - requested).total_seconds()
    print(f"\ncancel → runner stopped and finish recorded after {stopped_after:.2f}s "
          f"(heartbeat_interval {HEARTBEAT:g}s)")

    # A finish racing the cancel: the step succeeded, but its finish reaches the
    # control plane only after the cancel was recorded → the job ends cancelled.
    cp.add_task("cancel-2", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "cancel-2", "anyone-hold"), what="the second job to run")
    proxy.hold(r"POST .*/attempts/\d+/finish$")
    cp.open_gate("cancel-2")
    wait_for(proxy.held.is_set, what="the finish to be on its way")
    cp.cancel(job["instance_id"])
    wait_for(lambda: cp.events(job["id"], "cancel_requested"), what="the cancel to be recorded")
    proxy.release()
    done = wait_for(lambda: cp.all_done("cancel-2"), what="the racing finish", alive=(worker.proc,))[0]
    assert done["state"] == "cancelled"
    (attempt,) = cp.attempts(job["id"])
    assert (attempt["state"], attempt["job_state"]) == ("succeeded", "cancelled")
    (finish,) = proxy.matching(rf"/attempts/{attempt['id']}/finish$")
    assert finish.json()["outcome"] == "succeeded" and finish.answer() == {"job_state": "cancelled"}
    # The control plane commits before its answer reaches the worker, which logs it after.
    wait_for(lambda: re.search(rf"finish: job {job['id']} attempt {attempt['id']} outcome succeeded → job cancelled",
                               worker.output()), what="the worker to log the acknowledged finish", context=worker.tail)


# --------------------------------------------------------------------------- operations


def test_sigterm_drains_and_a_second_signal_cancels(cp, workers):
    (first,) = workers.start(("term-1", ALPHA))
    cp.add_task("sigterm-a", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "sigterm-a", "anyone-hold"), what="the job to run")

    first.send(signal.SIGTERM)
    wait_for(lambda: cp.worker_row("term-1")["draining"], what="the worker to report draining", alive=(first.proc,))
    cp.add_task("sigterm-b", "anyone-hold")  # it must not claim this one any more
    cp.open_gate("sigterm-a")
    assert first.wait() == 0, first.tail()
    assert cp.jobs("sigterm-a")[0]["state"] == "succeeded"
    assert [a["worker_id"] for a in succeeded(cp, job["id"])] == ["term-1"]
    waiting = cp.jobs("sigterm-b")[0]
    assert waiting["state"] == "queued" and cp.attempts(waiting["id"]) == []
    row = cp.worker_row("term-1")
    assert (row["ready"], row["draining"]) == (0, 1)

    # Twice: the first signal drains, the second stops the runner; the job reports cancelled.
    (second,) = workers.start(("term-2", BETA))
    wait_for(lambda: leased_job(cp, "sigterm-b", "anyone-hold"), what="the second worker to run sigterm-b")
    runner = cp.started(waiting["id"], 1)["pid"]
    second.send(signal.SIGTERM)
    wait_for(lambda: cp.worker_row("term-2")["draining"], what="draining", alive=(second.proc,))
    assert pid_running(runner)  # one signal leaves the running job alone
    second.send(signal.SIGTERM)
    assert second.wait() == 0, second.tail()
    assert not pid_running(runner)
    done = cp.jobs("sigterm-b")[0]
    assert done["state"] == "cancelled"
    assert [(a["worker_id"], a["state"]) for a in cp.attempts(done["id"])] == [("term-2", "cancelled")]
    assert cp.worker_row("term-2")["ready"] == 0


def test_drain_command_reaches_the_worker_through_its_heartbeat(cp, workers):
    (worker,) = workers.start(("drained", ALPHA))
    cp.add_task("drain-1", "anyone-hold")
    job = wait_for(lambda: leased_job(cp, "drain-1", "anyone-hold"), what="the job to run")
    out = cp.cli("worker", "drain", "drained").stdout
    assert "drain requested" in out
    wait_for(lambda: cp.worker_row("drained")["draining"], what="the worker to report draining", alive=(worker.proc,))
    assert "an operator asked this worker to drain" in worker.output()
    assert worker.proc.poll() is None  # still finishing its job
    cp.open_gate("drain-1")
    assert worker.wait() == 0, worker.tail()
    assert [a["state"] for a in cp.attempts(job["id"])] == ["succeeded"]
    assert cp.worker_row("drained")["ready"] == 0


def test_second_process_with_the_same_id_supersedes_the_first(cp, workers):
    (first,) = workers.start(("twin", ALPHA))
    (second,) = workers.start(("twin", ALPHA))
    code = first.wait()
    assert code != 0
    assert "another process registered worker id 'twin'" in first.output(), first.tail()
    assert second.proc.poll() is None
    second.send(signal.SIGTERM)
    assert second.wait() == 0, second.tail()


def test_remote_status_over_the_protocol(cp, workers):
    (worker,) = workers.start(("watched", BETA), token_from_env=("watched",))  # token from APIARY_WORKER_TOKEN
    local, remote = cp.status(), cp.status(remote=True)
    assert set(remote) == set(local) == {"jobs", "workers", "active", "blocked"}
    assert remote["jobs"] == local["jobs"]
    assert [w["worker_id"] for w in remote["workers"]] == [w["worker_id"] for w in local["workers"]]
    watched = next(w for w in remote["workers"] if w["worker_id"] == "watched")
    assert (watched["health"], watched["pool"], watched["ready"]) == ("healthy", "beta", True)

    elsewhere = cp.root / "elsewhere"
    text = cp.cli("status", "--control-plane", cp.url, config=False, cwd=elsewhere,
                  env={"APIARY_WORKER_TOKEN": CANARY}).stdout
    assert text.startswith("Jobs: ") and re.search(r"^\s+watched\s+beta\s+healthy", text, re.M), text

    wrong = "not-the-token-" + "x" * 20
    refused = cp.cli("status", "--json", "--control-plane", cp.url, "--token", wrong, config=False, cwd=elsewhere,
                     check=False)
    assert refused.returncode == 2 and "refused the worker token" in refused.stderr, refused.stderr
    assert wrong not in refused.stdout + refused.stderr
    assert worker.proc.poll() is None


def test_run_refuses_to_listen_without_a_token(tmp_path):
    port = free_port()
    config = tmp_path / "apiary.yaml"
    config.write_text(dump_config(project_config(listen=f"127.0.0.1:{port}", token=None, marks=tmp_path,
                                                 gates=tmp_path)))
    result = subprocess.run(command("run", "--config", str(config)), cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result
    assert "worker_token" in result.stderr and "listen" in result.stderr, result.stderr
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/api/worker/v1/status", timeout=2)


# --------------------------------------------------------------------------- the canary (keep last)


def test_canary_token_never_appears_in_logs_bodies_status_or_rows(cp, workers, canary_record):
    # At least one job through a worker of this test, so the scan has something to read on its own.
    proxy = workers.proxy()
    (worker,) = workers.start(("canary", ALPHA), via={"canary": proxy})
    cp.add_task("canary-1", "anyone-quick")
    wait_for(lambda: cp.all_done("canary-1"), what="the job to end", alive=(worker.proc,))

    # Error bodies: wrong, malformed and right tokens with bad input.
    bad = [
        requests.get(cp.api("status"), headers=cp.auth(CANARY + "x"), timeout=10),
        requests.get(cp.api("status"), params={"token": CANARY}, timeout=10),
        requests.post(cp.api("claims"), data="{not json", headers=cp.auth(), timeout=10),
        requests.post(cp.api("attempts/999999/heartbeat"), json={"token": CANARY}, headers=cp.auth(), timeout=10),
        requests.post(cp.api("attempts/999999/finish"), json={"token": CANARY, "outcome": "succeeded"},
                      headers=cp.auth(), timeout=10),
        requests.get(f"{cp.url}/api/worker/v0/status", headers=cp.auth(), timeout=10),
    ]
    assert [r.status_code for r in bad][:2] == [401, 401]
    for answer in bad:
        assert answer.status_code < 500 and CANARY not in answer.text, (answer.status_code, answer.text)

    texts = {"command output": "\n".join(cp.transcript)}
    texts |= {str(p): p.read_text(errors="replace") for p in cp.root.rglob("*.log")}
    for i, proxy in enumerate(canary_record["proxies"] + workers.proxies):
        texts[f"proxy {i}"] = "\n".join(e.response.decode(errors="replace") for e in proxy.exchanges)
    texts["status"] = json.dumps(cp.status()) + json.dumps(cp.status(remote=True)) + cp.cli("status").stdout
    assert any(p.name.startswith("worker-") for p in cp.root.rglob("*.log")), "no worker log was scanned"
    for where, text in texts.items():
        assert CANARY not in text, f"the worker token leaked into {where}"

    databases = [cp.db_path, *sorted(cp.root.glob("hosts/*/.apiary/workers/*.db"))]
    assert cp.root / "hosts" / "canary" / ".apiary" / "workers" / "canary.db" in databases
    for path in databases:
        assert stored_in(path, CANARY) == [], f"the worker token is stored in {path}"
    # The scan finds a planted canary (so an empty answer above means something).
    planted = cp.root / "planted.db"
    with sqlite3.connect(planted) as conn:
        conn.execute("CREATE TABLE t (n INTEGER, blob TEXT)")
        conn.execute("INSERT INTO t VALUES (1, ?)", (f"x{CANARY}y",))
    assert stored_in(planted, CANARY) == ["t.blob"]


def stored_in(path, needle: str) -> list[str]:
    """`table.column` of every text column of every table holding `needle`."""
    found = []
    with sqlite3.connect(path) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for column in [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")')]:
                hits = conn.execute(
                    f'SELECT COUNT(*) FROM "{table}" WHERE instr(CAST("{column}" AS TEXT), ?) > 0', (needle,)
                ).fetchone()[0]
                if hits:
                    found.append(f"{table}.{column}")
    return found

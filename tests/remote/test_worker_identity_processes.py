"""Worker identity with real processes (README "Security"): a holder of the
shared token cannot take over a running worker or stop `apiary run`, and the
shared token rotates under load with no job stopped or run twice.

The probe's attack, as it was: `POST workers/register {"worker_id": "wk1"}`
with the shared token killed wk1's step, made wk1 exit and handed the next
attempt to the attacker, who could finish it `succeeded` with a forged
summary; registering `embedded` made `apiary run` exit within 3 s.
"""

import re
import time

import pytest
import requests
import yaml

from .conftest import ALPHA, CANARY, ControlPlane, Workers, dump_config, wait_for
from .test_control_plane_restarts import own_control_plane, running_attempt

pytestmark = pytest.mark.processes

NEW_TOKEN = "rotated-token-4b1f9e0c7d2a48e6b3c5a9d1"  # ≥ 32 characters


def edit(cp: ControlPlane, change) -> None:
    config = yaml.safe_load(cp.config.read_text())
    change(config)
    cp.config.write_text(dump_config(config))


def post(cp: ControlPlane, path: str, body: dict, token: str) -> requests.Response:
    return requests.post(cp.api(path), json=body, headers=cp.auth(token), timeout=10)


@pytest.fixture
def plane_with_embedded_worker(tmp_path):
    def embedded(config: dict) -> None:
        config["settings"]["queue"]["embedded_worker"] = True  # the alpha pool's jobs are never its

    cp = ControlPlane(tmp_path / "identity", edit_config=embedded)
    with own_control_plane(cp) as workers:
        yield cp, workers


def test_a_shared_token_holder_cannot_take_over_a_running_worker_or_stop_apiary_run(plane_with_embedded_worker):
    cp, workers = plane_with_embedded_worker
    cp.start()
    embedded_session = wait_for(lambda: (row := cp.worker_row("embedded")) and row["session"],
                                what="the embedded worker to register", alive=(cp.proc,), context=cp.tail)
    (victim,) = workers.start(("victim", ALPHA))
    cp.add_task("held-1", "alpha-hold")
    attempt = wait_for(lambda: running_attempt(cp, "held-1", "alpha-hold"), what="the job to run on the victim",
                       alive=(victim.proc,), context=victim.tail)
    assert attempt["worker_id"] == "victim"
    victim_session = cp.worker_row("victim")["session"]

    spec = {"pool": "alpha", "labels": ["linux", "fast"], "capabilities": ["apiary.workflow", "runner:shell", "docker"],
            "capacity": 1}
    takeover = post(cp, "workers/register", {"worker_id": "victim", **spec}, CANARY)
    assert takeover.status_code == 403 and takeover.json()["error"]["code"] == "credential_required", takeover.text
    embedded = post(cp, "workers/register", {"worker_id": "embedded", **spec}, CANARY)
    assert embedded.status_code == 403 and embedded.json()["error"]["code"] == "reserved_worker_id", embedded.text

    # The attacker enrols an id of its own and tries to act as the victim with that credential.
    enrolled = post(cp, "workers/register", {"worker_id": "attacker", **spec}, CANARY)
    assert enrolled.status_code == 200, enrolled.text
    mine, session = enrolled.json()["credential"], enrolled.json()["session"]
    as_victim = [
        post(cp, "workers/victim/heartbeat", {"session": victim_session}, mine),
        post(cp, "claims", {"worker_id": "victim", "session": victim_session, "wait": 0}, mine),
        post(cp, "workers/register", {"worker_id": "victim", **spec}, mine),
    ]
    assert [(a.status_code, a.json()["error"]["code"]) for a in as_victim] == [(403, "worker_mismatch")] * 3
    assert post(cp, "claims", {"worker_id": "attacker", "session": session, "wait": 0}, mine).json() == {"jobs": []}

    # A few heartbeat rounds later nothing has moved: the victim runs on, `apiary run` serves on.
    time.sleep(1.0)  # not a lease: heartbeats every 0.5 s must have been answered meanwhile
    assert cp.proc.poll() is None and victim.proc.poll() is None, cp.tail() + victim.tail()
    assert cp.worker_row("embedded")["session"] == embedded_session
    assert cp.worker_row("victim")["session"] == victim_session
    [still] = cp.attempts(cp.jobs("held-1")[0]["id"])
    assert (still["id"], still["state"], still["worker_id"]) == (attempt["id"], "active", "victim")

    cp.open_gate("held-1")
    [done] = wait_for(lambda: cp.all_done("held-1"), what="the victim to finish its job", alive=(victim.proc,),
                      context=victim.tail)
    assert done["state"] == "succeeded" and "forged" not in (done["summary"] or "")
    assert [(a["state"], a["worker_id"]) for a in cp.attempts(done["id"])] == [("succeeded", "victim")]
    assert victim.proc.poll() is None and cp.proc.poll() is None


# Outlives a control-plane restart on a busy machine. What counts is the worker's self-fence,
# which stops a job lease - margin - grace (grace clamped to lease / 4) after its last answered
# heartbeat: 7.8 s at a 12 s lease, which one CI run's restart passed (the job ran twice); 13 s now.
ROTATION_LEASE = 20.0


@pytest.fixture
def rotation_plane(tmp_path):
    def longer_lease(config: dict) -> None:
        config["settings"]["queue"].update(lease_duration=f"{ROTATION_LEASE:g}s", heartbeat_interval="0.5s",
                                           worker_timeout="6s")

    cp = ControlPlane(tmp_path / "rotation", edit_config=longer_lease)
    with own_control_plane(cp) as workers:
        yield cp, workers


def test_rotating_the_shared_token_under_load_stops_and_repeats_no_job(rotation_plane):
    """The README's rotation procedure with jobs running: the new token becomes
    worker_token, the old one a previous_worker_token, the control plane
    restarts; running workers keep their jobs (they call with their own
    credentials), a worker still on the old token enrols, one on the new
    token too; every job succeeds on its first and only attempt."""
    cp, workers = rotation_plane
    cp.start()
    running = workers.start(("steady-1", ALPHA), ("steady-2", ALPHA))
    held = [f"rot-{i}" for i in range(4)]
    for title in held[:2]:
        cp.add_task(title, "alpha-hold")
    wait_for(lambda: all(running_attempt(cp, t, "alpha-hold") for t in held[:2]), what="two jobs running",
             alive=tuple(w.proc for w in running), context=lambda: "\n".join(w.tail() for w in running))

    def rotate(config: dict) -> None:
        config["settings"]["queue"].update(worker_token=NEW_TOKEN, previous_worker_tokens=[CANARY])

    edit(cp, rotate)
    cp.stop()
    cp.start()  # serving() authenticates with the old token: accepted as a previous one
    late = Workers(cp)
    try:
        (old_token,) = late.start(("late-old", ALPHA))
        (new_token,) = late.start(("late-new", ALPHA), token=NEW_TOKEN)
        for title in held[2:]:
            cp.add_task(title, "alpha-hold")
        for title in held:
            cp.open_gate(title)
        everyone = (*running, old_token, new_token)
        jobs = wait_for(lambda: cp.all_done(*held, count=len(held)), what="every job to finish",
                        alive=tuple(w.proc for w in everyone), context=lambda: "\n".join(w.tail() for w in everyone))
        assert {j["state"] for j in jobs} == {"succeeded"}
        for job in jobs:
            attempts = cp.attempts(job["id"])
            assert [a["state"] for a in attempts] == ["succeeded"], (job["id"], [dict(a) for a in attempts])
        for worker in everyone:
            log = worker.output()
            assert not re.search(r"discard|self-fenced|refused the worker token|refused this worker", log), worker.tail()
            assert worker.proc.poll() is None, worker.tail()
        assert "previous_worker_tokens[0]" in cp.output(), cp.tail()  # the old token's use was logged as old
        assert NEW_TOKEN not in cp.output() and CANARY not in cp.output()
    finally:
        late.close()

"""Workflow effects (issue 10, "Proofs required") with real processes: a
control plane and `apiary worker` processes on loopback, killed (-9),
stopped (SIGSTOP) and restarted for real.

The module builds its own control plane (conftest's `ControlPlane` with
workflows of `publish: true`, `spawn: true` and `hooks` added). Each shell
step appends one line to `marks/<task title>.<mark>` whenever it runs (the
worker, attempt, APIARY_EFFECT_KEY, APIARY_EFFECT_RETRY, APIARY_RESUMED,
APIARY_HOOK_OUTCOME), so a test counts how many times a command ran and
with what; a step that waits does so on `gates/<task title>.<gate>`, so the
test decides when a step is mid-run. "Crashing" a worker is SIGKILL of the
worker process and of its step's process group (the whole host gone: no
orphaned step runs on). Every wait has the conftest's deadline (WAIT); the
short lease (3 s, heartbeat 0.5 s) makes expiries come fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import pytest

from tests.daemon import group_alive, recorded_groups

from .conftest import ALPHA, BETA, ControlPlane, WorkerProcess, pid_running, wait_for

pytestmark = pytest.mark.processes

# Shell helpers every step starts with. `mark NAME [extra…]` appends a line; `gate NAME` waits for its gate.
HELPERS = r"""
mark() {
  name=$1; shift
  printf 'worker=%s attempt=%s key=%s retry=%s resumed=%s outcome=%s %s\n' "$APIARY_WORKER_ID" "$APIARY_ATTEMPT" \
    "$APIARY_EFFECT_KEY" "$APIARY_EFFECT_RETRY" "$APIARY_RESUMED" "$APIARY_HOOK_OUTCOME" "$*" \
    >> "$MARKS/$APIARY_TASK_TITLE.$name"
}
gate() { while [ ! -e "$GATES/$APIARY_TASK_TITLE.$1" ]; do sleep 0.05; done; }
"""


def sh(text: str) -> str:
    return HELPERS + text


# prep → pub (publish; waits on gate "pub") → after (waits on gate "after"; writes what it saw of pub's output).
PUBLISH_STEPS = [
    {"id": "prep", "run": sh("mark prep\nprintf prep-output"), "timeout": "120s"},
    {
        "id": "pub",
        "publish": True,
        "run": sh('mark pub.begin\ngate pub\nmark pub.end\nprintf "published-%s" "$APIARY_ATTEMPT"'),
        "timeout": "120s",
    },
    {
        "id": "after",
        "run": sh('mark after\ngate after\nprintf %s {{ steps.pub.output }} > "$MARKS/$APIARY_TASK_TITLE.after-saw"'),
        "timeout": "120s",
    },
]

# One child line per child: a spawn step's stdout.
SPAWN_OUTPUT = (
    'printf \'{"id": "c1", "title": "%s-child-1", "workflows": ["fx-child"]}\\n\' "$APIARY_TASK_TITLE"\n'
    'printf \'{"id": "c2", "title": "%s-child-2", "workflows": ["fx-child"]}\\n\' "$APIARY_TASK_TITLE"\n'
)

RESUME_STEPS = [
    {"id": "one", "run": sh("mark one\nprintf out-one"), "timeout": "120s"},
    {"id": "two", "run": sh("mark two\nprintf out-two"), "timeout": "120s"},
    {
        "id": "three",
        "run": sh(
            'ck=$(cat "$APIARY_CHECKPOINT" 2>/dev/null)\n'
            'mark three "ckpt=$ck" "saw="{{ steps.one.output }}"+"{{ steps.two.output }}\n'
            'if [ -z "$APIARY_RESUMED" ]; then printf progress-42 > "$APIARY_CHECKPOINT"; fi\n'
            "gate three\n"
            "printf out-three"
        ),
        "timeout": "120s",
    },
]


def effect_workflows(config: dict) -> None:
    config["settings"]["queue"]["max_attempts"] = 5
    config["workflows"] += [
        {"id": "fx-publish", "agent": "anyone", "steps": PUBLISH_STEPS},
        {
            "id": "fx-stale",
            "agent": "anyone",
            "steps": [
                # Each attempt's prep waits on a gate of its own: the test ends them one at a time.
                {"id": "prep", "run": sh('mark prep\ngate "prep.$APIARY_ATTEMPT"\nprintf prep-output'), "timeout": "120s"},
                {"id": "pub", "publish": True, "run": sh("mark pub\nprintf published"), "timeout": "120s"},
                {"id": "split", "spawn": True, "run": sh("mark split\n" + SPAWN_OUTPUT), "timeout": "120s"},
            ],
        },
        {
            "id": "fx-spawn",
            "agent": "anyone",
            "steps": [
                {"id": "split", "spawn": True, "run": sh("mark split\n" + SPAWN_OUTPUT), "timeout": "120s"},
                {"id": "hold", "run": sh("mark hold\ngate hold"), "timeout": "120s"},
            ],
        },
        {"id": "fx-child", "agent": "anyone", "steps": [{"id": "work", "run": sh("mark child"), "timeout": "120s"}]},
        {
            "id": "fx-hooked",
            "agent": "anyone",
            "steps": [{"id": "work", "run": sh("mark work\ngate work"), "timeout": "120s"}],
            "hooks": {
                "on_success": [{"id": "tell", "run": sh("mark hook"), "timeout": "120s"}],
                "on_failure": [{"id": "tell", "run": sh("mark hook-failure"), "timeout": "120s"}],
            },
        },
        {
            "id": "fx-badhook",
            "agent": "anyone",
            "retry": {"max_attempts": 2, "backoff": "0s"},
            "steps": [{"id": "work", "run": sh("mark work"), "timeout": "120s"}],
            "hooks": {"on_success": [{"id": "tell", "run": sh("mark hook\nexit 3"), "timeout": "120s"}]},
        },
        {
            "id": "fx-hookkill",
            "agent": "anyone",
            "steps": [{"id": "work", "run": sh("mark work"), "timeout": "120s"}],
            "hooks": {
                "on_success": [
                    {"id": "tell", "run": sh("mark hook"), "timeout": "120s"},
                    {"id": "hold", "run": sh("mark hold\ngate hold"), "timeout": "120s"},
                ],
            },
        },
        {"id": "fx-resume", "agent": "sticky", "steps": RESUME_STEPS},
    ]


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    """This module's control plane (it replaces the conftest's `cp`, so the conftest's `workers` uses it)."""
    plane = ControlPlane(tmp_path_factory.mktemp("effects"), edit_config=effect_workflows)
    plane.start()
    yield plane
    if plane.proc.poll() is None:
        plane.stop()


# --------------------------------------------------------------------------- helpers


def marks(cp: ControlPlane, title: str, name: str) -> list[dict]:
    """The lines of one mark file, each as {field: value} (the free text under "extra")."""
    path = cp.marks / f"{title}.{name}"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    parsed = []
    for line in lines:
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        parsed.append(fields)
    return parsed


def gate(cp: ControlPlane, title: str, name: str) -> None:
    (cp.gates / f"{title}.{name}").touch()


def add(cp: ControlPlane, title: str, workflow: str) -> dict:
    cp.add_task(title, workflow)
    return wait_for(lambda: workflow_job(cp, title, workflow), what=f"the job of {title}")


def workflow_job(cp: ControlPlane, title: str, workflow: str) -> dict | None:
    """The task's workflow job (not its hook jobs), as a dict."""
    rows = cp.rows(
        "SELECT j.id, j.state, CAST(j.payload->>'instance_id' AS INTEGER) AS instance_id FROM queue_job j"
        " JOIN workflows_task t ON t.id = CAST(j.payload->'task'->>'id' AS INTEGER)"
        " WHERE t.title = ? AND j.payload->>'workflow' = ? AND j.payload->'hook' IS NULL ORDER BY j.id",
        title, workflow,
    )
    return dict(rows[0]) if rows else None


def job_state(cp: ControlPlane, job_id: int) -> str:
    return cp.value("SELECT state FROM queue_job WHERE id = ?", job_id)


def ended(cp: ControlPlane, job_id: int) -> str | None:
    state = job_state(cp, job_id)
    return state if state in ("succeeded", "failed", "cancelled") else None


def records(cp: ControlPlane, job_id: int) -> dict[str, dict]:
    rows = cp.rows("SELECT key, state, value, attempt_number, started_by FROM queue_jobrecord WHERE job_id = ?", job_id)
    return {r["key"]: {**dict(r), "value": json.loads(r["value"])} for r in rows}


def worker_of(cp: ControlPlane, job_id: int, number: int) -> str | None:
    attempts = cp.attempts(job_id)
    return attempts[number - 1]["worker_id"] if len(attempts) >= number else None


def crash(worker: WorkerProcess) -> None:
    """The host dies: SIGKILL the worker, then its steps' process groups (nothing of it runs on)."""
    groups = worker.runner_groups()
    worker.proc.kill()
    worker.proc.wait(timeout=10)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: not any(pid_running(g) for g in groups), what=f"the steps of {worker} to be gone", timeout=15)


def context_of(cp: ControlPlane, *procs: WorkerProcess):
    return lambda: "\n".join([cp.tail(), *(p.tail() for p in procs)])


def pair(workers, prefix: str) -> dict[str, WorkerProcess]:
    return {w.worker_id: w for w in workers.start((f"{prefix}-alpha", ALPHA), (f"{prefix}-beta", BETA))}


# --------------------------------------------------------------------------- 1. kill -9 after publish succeeded


def test_worker_killed_after_publish_succeeded_publish_runs_once_in_all(cp, workers):
    title = "pubdone-1"
    gate(cp, title, "pub")  # the publish command runs through; the job holds in "after"
    procs = pair(workers, "pubdone")
    job = add(cp, title, "fx-publish")
    wait_for(lambda: marks(cp, title, "after"), what="step after to run (the publish is done)",
             alive=tuple(w.proc for w in procs.values()), context=context_of(cp, *procs.values()))
    assert records(cp, job["id"])["publish:pub"]["state"] == "done"
    victim = procs[worker_of(cp, job["id"], 1)]
    survivor = next(w for w in procs.values() if w is not victim)
    crash(victim)

    wait_for(lambda: len(marks(cp, title, "after")) == 2, what="step after to run again on the other worker",
             alive=(survivor.proc,), context=context_of(cp, survivor))
    gate(cp, title, "after")
    assert wait_for(lambda: ended(cp, job["id"]), what="the job to end", alive=(survivor.proc,),
                    context=context_of(cp, survivor)) == "succeeded"

    attempts = cp.attempts(job["id"])
    assert [(a["number"], a["worker_id"], a["state"]) for a in attempts] == [
        (1, victim.worker_id, "expired"), (2, survivor.worker_id, "succeeded")
    ]
    # The publish command ran exactly once in all (on the killed worker); the reclaim reused its output.
    assert len(marks(cp, title, "pub.begin")) == len(marks(cp, title, "pub.end")) == 1
    assert marks(cp, title, "pub.end")[0]["worker"] == victim.worker_id
    assert (cp.marks / f"{title}.after-saw").read_text() == "published-1"
    # Elsewhere the other steps start over: prep and after ran on both.
    assert [m["worker"] for m in marks(cp, title, "prep")] == [victim.worker_id, survivor.worker_id]
    assert [m["worker"] for m in marks(cp, title, "after")] == [victim.worker_id, survivor.worker_id]
    assert records(cp, job["id"])["publish:pub"]["value"]["output"] == "published-1"


def embedded(config: dict) -> None:
    effect_workflows(config)
    config["settings"]["queue"]["embedded_worker"] = True


@contextlib.contextmanager
def embedded_plane(tmp_path, title: str):
    """`apiary run` with the embedded worker, started; afterwards every gate of `title` is opened,
    the daemon stopped and any step it left killed."""
    plane = ControlPlane(tmp_path / "embedded", edit_config=embedded)
    try:
        plane.start()
        yield plane
    finally:
        for name in ("pub", "after"):
            gate(plane, title, name)
        if plane.proc is not None:
            plane.stop()
        for pgid in recorded_groups(plane.root / ".apiary"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def crash_embedded(plane: ControlPlane) -> list[int]:
    """The host dies: SIGKILL `apiary run` and its steps' process groups; returns the groups."""
    groups = recorded_groups(plane.root / ".apiary")
    assert groups, "the running step's process group is not recorded"
    plane.kill()
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return groups


def test_embedded_worker_killed_after_publish_succeeded_publish_runs_once_in_all(tmp_path):
    """The same with the embedded worker: SIGKILL `apiary run` (and its step) and start it again."""
    title = "pubembedded-1"
    with embedded_plane(tmp_path, title) as plane:
        gate(plane, title, "pub")
        job = add(plane, title, "fx-publish")
        wait_for(lambda: marks(plane, title, "after"), what="step after to run (the publish is done)",
                 alive=(plane.proc,), context=plane.tail)
        assert records(plane, job["id"])["publish:pub"]["state"] == "done"
        crash_embedded(plane)
        plane.start()
        wait_for(lambda: len(marks(plane, title, "after")) == 2, what="step after to run again",
                 alive=(plane.proc,), context=plane.tail)
        gate(plane, title, "after")
        assert wait_for(lambda: ended(plane, job["id"]), what="the job to end", alive=(plane.proc,),
                        context=plane.tail) == "succeeded"
        assert [a["state"] for a in plane.attempts(job["id"])] == ["expired", "succeeded"]
        assert len(marks(plane, title, "pub.begin")) == len(marks(plane, title, "pub.end")) == 1
        assert (plane.marks / f"{title}.after-saw").read_text() == "published-1"
        # The same worker id in the same workspace: prep was skipped too (its success reused).
        assert len(marks(plane, title, "prep")) == 1


# --------------------------------------------------------------------------- 2. kill -9 mid-publish


def test_worker_killed_mid_publish_runs_it_again_with_the_same_key_and_retry_set(cp, workers):
    title = "pubmid-1"
    gate(cp, title, "after")
    procs = pair(workers, "pubmid")
    job = add(cp, title, "fx-publish")
    wait_for(lambda: marks(cp, title, "pub.begin"), what="the publish command to start",
             alive=tuple(w.proc for w in procs.values()), context=context_of(cp, *procs.values()))
    assert records(cp, job["id"])["publish:pub"]["state"] == "started"
    victim = procs[worker_of(cp, job["id"], 1)]
    survivor = next(w for w in procs.values() if w is not victim)
    crash(victim)

    wait_for(lambda: len(marks(cp, title, "pub.begin")) == 2, what="the publish command to run again",
             alive=(survivor.proc,), context=context_of(cp, survivor))
    gate(cp, title, "pub")
    assert wait_for(lambda: ended(cp, job["id"]), what="the job to end", alive=(survivor.proc,),
                    context=context_of(cp, survivor)) == "succeeded"

    first, second = marks(cp, title, "pub.begin")
    assert (first["worker"], second["worker"]) == (victim.worker_id, survivor.worker_id)
    assert first["key"] and first["key"] == second["key"], (first, second)
    assert (first["retry"], second["retry"]) == ("", "1")
    # The killed run never ended; the retry did, once.
    assert [m["worker"] for m in marks(cp, title, "pub.end")] == [survivor.worker_id]
    assert (cp.marks / f"{title}.after-saw").read_text() == "published-2"
    record = records(cp, job["id"])["publish:pub"]
    assert (record["state"], record["value"]["output"]) == ("done", "published-2")


def test_embedded_worker_killed_mid_publish_runs_it_again_with_the_same_key_and_retry_set(tmp_path):
    """The same with the embedded worker: SIGKILL `apiary run` (and its step) while the publish
    command runs, and start it again."""
    title = "pubmidembedded-1"
    with embedded_plane(tmp_path, title) as plane:
        gate(plane, title, "after")
        job = add(plane, title, "fx-publish")
        wait_for(lambda: marks(plane, title, "pub.begin"), what="the publish command to start",
                 alive=(plane.proc,), context=plane.tail)
        assert records(plane, job["id"])["publish:pub"]["state"] == "started"
        groups = crash_embedded(plane)
        # Gone before its gate opens: the killed run must never reach pub.end.
        wait_for(lambda: not any(group_alive(g) for g in groups), what="the killed publish command to be gone",
                 timeout=15, context=plane.tail)
        plane.start()
        wait_for(lambda: len(marks(plane, title, "pub.begin")) == 2, what="the publish command to run again",
                 alive=(plane.proc,), context=plane.tail)
        gate(plane, title, "pub")
        assert wait_for(lambda: ended(plane, job["id"]), what="the job to end", alive=(plane.proc,),
                        context=plane.tail) == "succeeded"

        assert [(a["number"], a["state"]) for a in plane.attempts(job["id"])] == [(1, "expired"), (2, "succeeded")]
        first, second = marks(plane, title, "pub.begin")
        assert (first["attempt"], second["attempt"]) == ("1", "2")
        assert first["key"] and first["key"] == second["key"], (first, second)
        assert (first["retry"], second["retry"]) == ("", "1")
        # The killed run never ended; the retry did, once.
        assert [m["attempt"] for m in marks(plane, title, "pub.end")] == ["2"]
        assert (plane.marks / f"{title}.after-saw").read_text() == "published-2"
        record = records(plane, job["id"])["publish:pub"]
        assert (record["state"], record["value"]["output"]) == ("done", "published-2")
        # The same worker id in the same workspace: prep, recorded done, was not run again.
        assert len(marks(plane, title, "prep")) == 1
        assert len(marks(plane, title, "after")) == 1


# --------------------------------------------------------------------------- 3. a stale attempt


def test_stale_attempt_records_no_publish_or_spawn_and_the_instance_has_one_writer(cp, workers):
    """Attempt 1's worker is SIGSTOPped in step prep until its lease is gone and attempt 2, on the
    other worker, holds in its own prep. Attempt 1's prep command then ends (its gate opens while
    its worker is still stopped) and only then is the worker continued: the first thing its job
    thread does is write `step:prep` done, and next (were that accepted) `publish:pub` started
    and the publish command — all while the journal is still empty, since attempt 2 records
    nothing until the test opens its gate, after the stale worker has discarded its result.

    Why this fails without fencing: the step's process has already exited with 0 when the
    worker resumes, so the runner reports success and the journal sends the write whatever
    the worker's own self-fence does meanwhile (a journal write does not look at the cancel
    event; the self-fence, racing, is logged first). Only the control plane can refuse it.
    Were it accepted: the discard's reason would be the self-fence, not a refused journal
    write; `step:prep` would be recorded by attempt 1, so the journal is not empty after the
    discard, and since `done` is final it stays attempt 1's ("every record is attempt 2's"
    fails); and if the self-fence had not cancelled the job by then, the stale attempt would
    go on to record the publish's `started` and run the publish and the spawn (marks of
    attempt 1). (The gate opens before SIGCONT on purpose: opened after, the self-fence would
    stop the step before it ended and the stale attempt would write nothing at all.)"""
    title = "pubstale-1"
    procs = pair(workers, "pubstale")
    job = add(cp, title, "fx-stale")
    wait_for(lambda: marks(cp, title, "prep"), what="step prep to run",
             alive=tuple(w.proc for w in procs.values()), context=context_of(cp, *procs.values()))
    stale = procs[worker_of(cp, job["id"], 1)]
    fresh = next(w for w in procs.values() if w is not stale)
    stale_groups = wait_for(stale.runner_groups, what="the stale attempt's prep to record its process group",
                            alive=(stale.proc,), context=stale.tail)

    stale.send(signal.SIGSTOP)  # the worker only: its step still runs, waiting on gate prep.1
    try:
        wait_for(lambda: len(marks(cp, title, "prep")) == 2, what="the other worker to take the job",
                 alive=(fresh.proc,), context=context_of(cp, fresh))
        first, second = cp.attempts(job["id"])
        assert (first["state"], second["worker_id"], second["state"]) == ("expired", fresh.worker_id, "active")
        assert records(cp, job["id"]) == {}  # attempt 2 holds in prep: nothing recorded by anyone yet
        gate(cp, title, "prep.1")  # the stale prep ends while its worker is stopped
        wait_for(lambda: not any(group_alive(g) for g in stale_groups), what="the stale attempt's prep to end",
                 alive=(fresh.proc,), context=context_of(cp, fresh))
    finally:
        stale.send(signal.SIGCONT)

    discarded = re.compile(rf"job {job['id']} attempt {first['id']} result discarded: (.*)")
    found = wait_for(lambda: discarded.search(stale.output()), what="the stale worker to discard its result",
                     alive=(stale.proc, fresh.proc), context=context_of(cp, stale, fresh))
    # It tried to record (its step's success) and the control plane refused it as stale ...
    assert "refused a journal write as stale" in found.group(1), stale.tail()
    # ... so nothing is recorded: attempt 2 still holds in prep, and attempt 1's write was dropped.
    assert records(cp, job["id"]) == {}
    assert marks(cp, title, "pub") == [] and marks(cp, title, "split") == []

    gate(cp, title, "prep.2")
    assert wait_for(lambda: ended(cp, job["id"]), what="the new attempt to finish", alive=(fresh.proc,),
                    context=context_of(cp, fresh)) == "succeeded"
    # The stale attempt ran no publish and no spawn: one run of each, the fresh attempt's.
    assert [(m["worker"], m["attempt"]) for m in marks(cp, title, "prep")] == [
        (stale.worker_id, "1"), (fresh.worker_id, "2")
    ]
    assert [(m["worker"], m["attempt"]) for m in marks(cp, title, "pub")] == [(fresh.worker_id, "2")]
    assert [(m["worker"], m["attempt"]) for m in marks(cp, title, "split")] == [(fresh.worker_id, "2")]
    for child in (f"{title}-child-1", f"{title}-child-2"):
        wait_for(lambda c=child: (j := workflow_job(cp, c, "fx-child")) and ended(cp, j["id"]),
                 what=f"{child} to run", alive=(fresh.proc,), context=context_of(cp, fresh))
        assert cp.value("SELECT COUNT(*) FROM workflows_task WHERE title = ?", child) == 1
        assert len(marks(cp, child, "child")) == 1
    assert cp.value("SELECT COUNT(*) FROM workflows_spawn WHERE job_id = ?", job["id"]) == 1
    # Every record of the job was written by attempt 2 alone.
    recorded = records(cp, job["id"])
    assert {"step:prep", "publish:pub", "step:pub", "spawn:split", "step:split"} <= set(recorded), recorded
    assert {(k, r["attempt_number"]) for k, r in recorded.items()} == {(k, 2) for k in recorded}, recorded
    assert recorded["publish:pub"]["started_by"] == 2, recorded["publish:pub"]
    assert [(a["number"], a["state"]) for a in cp.attempts(job["id"])] == [(1, "expired"), (2, "succeeded")]


# --------------------------------------------------------------------------- 4. spawn across a crash


def test_spawn_after_a_crash_creates_each_child_once_and_children_run(cp, workers):
    title = "spawn-1"
    procs = pair(workers, "spawn")
    job = add(cp, title, "fx-spawn")
    wait_for(lambda: marks(cp, title, "hold"), what="the step after the spawn to run",
             alive=tuple(w.proc for w in procs.values()), context=context_of(cp, *procs.values()))
    assert records(cp, job["id"])["spawn:split"]["state"] == "done"
    victim = procs[worker_of(cp, job["id"], 1)]
    survivor = next(w for w in procs.values() if w is not victim)
    crash(victim)

    wait_for(lambda: len(marks(cp, title, "hold")) == 2, what="the job to run again on the other worker",
             alive=(survivor.proc,), context=context_of(cp, survivor))
    gate(cp, title, "hold")
    assert wait_for(lambda: ended(cp, job["id"]), what="the parent to end", alive=(survivor.proc,),
                    context=context_of(cp, survivor)) == "succeeded"
    children = [f"{title}-child-1", f"{title}-child-2"]
    child_jobs = {
        child: wait_for(lambda c=child: (j := workflow_job(cp, c, "fx-child")) and ended(cp, j["id"]) and j,
                        what=f"{child} to run", alive=(survivor.proc,), context=context_of(cp, survivor))
        for child in children
    }

    assert len(marks(cp, title, "split")) == 1  # the recorded spawn was not run again
    parent_instance = job["instance_id"]
    for child, child_job in child_jobs.items():
        assert job_state(cp, child_job["id"]) == "succeeded"
        tasks = cp.rows("SELECT id FROM workflows_task WHERE title = ?", child)
        assert len(tasks) == 1, f"{child}: {len(tasks)} tasks"
        instances = cp.rows("SELECT id, parent_id FROM workflows_workflowinstance WHERE task_id = ?", tasks[0]["id"])
        assert [i["parent_id"] for i in instances] == [parent_instance]
        assert len(marks(cp, child, "child")) == 1
    assert cp.value("SELECT COUNT(*) FROM workflows_spawn WHERE job_id = ?", job["id"]) == 1


# --------------------------------------------------------------------------- 5. hooks


def hook_jobs(cp: ControlPlane, instance_id: int) -> list[dict]:
    return [dict(r) for r in cp.rows(
        "SELECT id, state, payload->'hook'->>'outcome' AS outcome FROM queue_job"
        " WHERE payload->'hook' IS NOT NULL AND CAST(payload->>'instance_id' AS INTEGER) = ? ORDER BY id",
        instance_id,
    )]


def test_hook_runs_once_across_a_control_plane_sigkill_and_restart(cp, workers):
    title = "hooked-1"
    (worker,) = workers.start(("hooker", ALPHA))
    job = add(cp, title, "fx-hooked")
    wait_for(lambda: marks(cp, title, "work"), what="the step to run", alive=(worker.proc,), context=worker.tail)
    gate(cp, title, "work")
    wait_for(lambda: ended(cp, job["id"]), what="the job to end", alive=(worker.proc,), context=worker.tail)
    cp.kill()  # right after the outcome committed; the hook job may or may not have been claimed yet
    cp.start()

    hook = wait_for(lambda: (h := hook_jobs(cp, job["instance_id"])) and ended(cp, h[0]["id"]) and h,
                    what="the hook job to end", alive=(worker.proc, cp.proc), context=context_of(cp, worker))
    assert job_state(cp, job["id"]) == "succeeded"
    assert [(h["outcome"], h["state"]) for h in hook] == [("succeeded", "succeeded")]
    (run,) = marks(cp, title, "hook")
    assert (run["outcome"], run["worker"]) == ("succeeded", "hooker") and run["key"]
    assert marks(cp, title, "hook-failure") == []
    assert len(marks(cp, title, "work")) == 1


def test_hook_steps_run_once_to_success_across_a_worker_kill(cp, workers):
    """The hook job's worker dies in its second step: the reclaim, on the other worker, does not
    run the first (recorded done) again, and runs the second again with its key and retry set."""
    title = "hookkill-1"
    procs = pair(workers, "hookkill")
    job = add(cp, title, "fx-hookkill")
    wait_for(lambda: marks(cp, title, "hold"), what="the hook's second step to start",
             alive=tuple(w.proc for w in procs.values()), context=context_of(cp, *procs.values()))
    (hook,) = hook_jobs(cp, job["instance_id"])
    victim = procs[worker_of(cp, hook["id"], 1)]
    survivor = next(w for w in procs.values() if w is not victim)
    crash(victim)

    wait_for(lambda: len(marks(cp, title, "hold")) == 2, what="the hook's second step to run again",
             alive=(survivor.proc,), context=context_of(cp, survivor))
    gate(cp, title, "hold")
    assert wait_for(lambda: ended(cp, hook["id"]), what="the hook job to end", alive=(survivor.proc,),
                    context=context_of(cp, survivor)) == "succeeded"
    assert [(a["worker_id"], a["state"]) for a in cp.attempts(hook["id"])] == [
        (victim.worker_id, "expired"), (survivor.worker_id, "succeeded")
    ]
    (told,) = marks(cp, title, "hook")  # once in all
    assert (told["worker"], told["outcome"]) == (victim.worker_id, "succeeded")
    first, second = marks(cp, title, "hold")
    assert (first["worker"], second["worker"]) == (victim.worker_id, survivor.worker_id)
    assert first["key"] == second["key"] == told["key"] and (first["retry"], second["retry"]) == ("", "1")
    assert job_state(cp, job["id"]) == "succeeded" and len(marks(cp, title, "work")) == 1


def test_failing_hook_is_retried_and_shown_failed_without_changing_the_instance(cp, workers):
    title = "badhook-1"
    (worker,) = workers.start(("badhooker", BETA))
    job = add(cp, title, "fx-badhook")
    hook = wait_for(lambda: (h := hook_jobs(cp, job["instance_id"])) and ended(cp, h[0]["id"]) and h,
                    what="the hook job to end", alive=(worker.proc,), context=context_of(cp, worker))
    assert [(h["outcome"], h["state"]) for h in hook] == [("succeeded", "failed")]
    attempts = cp.attempts(hook[0]["id"])
    assert [(a["number"], a["state"]) for a in attempts] == [(1, "failed"), (2, "failed")]  # retry max_attempts: 2
    runs = marks(cp, title, "hook")
    assert [r["attempt"] for r in runs] == ["1", "2"] and len({r["key"] for r in runs}) == 1
    assert job_state(cp, job["id"]) == "succeeded"  # the instance's outcome is its own
    assert len(marks(cp, title, "work")) == 1
    status = cp.status()
    assert not any(a.get("instance_id") == job["instance_id"] for a in status["active"]), status["active"]


# --------------------------------------------------------------------------- 6. resume on an affinity-pinned worker


def test_three_steps_killed_in_step_three_resume_there_on_the_pinned_worker_with_the_checkpoint(cp, workers):
    title = "resume-1"
    (first,) = workers.start(("pinned-host", ALPHA))
    job = add(cp, title, "fx-resume")
    wait_for(lambda: marks(cp, title, "three"), what="step three to run", alive=(first.proc,), context=first.tail)

    def checkpoint_kept():
        record = records(cp, job["id"]).get("checkpoint:three")
        return record and record["value"].get("content") == "progress-42"

    wait_for(checkpoint_kept, what="a heartbeat to carry step three's checkpoint", alive=(first.proc,),
             context=first.tail)
    crash(first)
    gate(cp, title, "three")
    # The same worker id, in the same folder: it comes back to its workspace.
    (again,) = workers.start(("pinned-host", ALPHA))
    assert again.directory == first.directory
    assert wait_for(lambda: ended(cp, job["id"]), what="the job to end", alive=(again.proc,),
                    context=context_of(cp, again)) == "succeeded"

    assert [a["worker_id"] for a in cp.attempts(job["id"])] == ["pinned-host", "pinned-host"]
    assert len(marks(cp, title, "one")) == len(marks(cp, title, "two")) == 1
    before, after = marks(cp, title, "three")
    assert (before["attempt"], before["resumed"], before["ckpt"]) == ("1", "", "")
    assert (after["attempt"], after["resumed"], after["ckpt"]) == ("2", "1", "progress-42")
    assert before["saw"] == after["saw"] == "out-one+out-two"
    assert "step one skipped" in again.output() and "step two skipped" in again.output(), again.tail()


"""The executor's effect ledger (issue 10), through a job's real journal on the
in-process transport: resumption in the same workspace, publish at most once
(and again with APIARY_EFFECT_RETRY when its end is unknown), spawn recorded
once, checkpoints carried by heartbeats and pre-filled for the next attempt,
nothing run or recorded by a stale attempt, and hook jobs.

Attempts are made by hand: claim, run the executor, then expire the lease on
the frozen clock and claim again, as a worker that died would leave it."""

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from django.contrib import admin

from jobqueue import services
from jobqueue.models import Job
from jobqueue.types import Claim
from tests.factories import claim, enqueue, register
from tests.waiting import wait_for
from workers.journal import Journal
from workers.localdb import LocalDB
from workers.pgroups import ProcessGroups
from workers.runtime import WorkerRuntime
from workers.transport import InProcessTransport, WorkerSpec
from workers.verdicts import Verdict
from workflows import effects, payload
from workflows.admin import StepRunInline
from workflows.config import load
from workflows.config.loading import ConfigError
from workflows.executor import SKIPPED_NOTES, Executor
from workflows.history import DatabaseHistory
from workflows.models import StepRun, WorkflowInstance

pytestmark = pytest.mark.django_db

LEASE = 30.0
GRACE = 0.5
WAIT = 10.0

CONFIG = """
project: effects
agents:
  - id: sh
    runner: shell
    command: cat
workflows:
  - id: triage
    agent: sh
    steps:
{steps}
    hooks:
      on_success: [{{run: 'printf "%s %s %s" "$APIARY_HOOK_OUTCOME" "$APIARY_EFFECT_KEY" "$APIARY_STEP_ID" > hook.out'}}]
      on_failure: [{{run: "exit 4"}}]
"""

# Each command appends (`$${` is a literal `${` in apiary.yaml) a line to $COUNTS/<step> when it runs, so a test counts the runs.
STEPS = {
    "plan": {"run": 'echo ran >> "$COUNTS/plan"; printf plan-output'},
    "pub": {
        "run": 'echo "$${APIARY_EFFECT_KEY}|$${APIARY_EFFECT_RETRY:-}" >> "$COUNTS/pub"; '
        'test -f "$COUNTS/pub-fails" && exit 2; printf https://example/pr/1',
        "publish": True,
    },
    "last": {"run": 'printf %s {{ steps.pub.output }}/{{ steps.plan.output }} > last.out; test ! -f "$COUNTS/last-fails"'},
}


class History:
    """Step history by history step id; `on_finished(step_id)` runs after each step's row is finished."""

    def __init__(self, on_finished=lambda step_id: None):
        self.rows: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.on_finished = on_finished

    def step_started(self, *, claim, worker_id, step_id, started_at, log_path):
        self.rows[step_id] = "running"

    def step_finished(self, *, claim, worker_id, step_id, result):
        self.rows[step_id] = result.status
        self.notes[step_id] = result.output_tail
        self.on_finished(step_id)


@pytest.fixture(autouse=True)
def queue_settings(queue_config, clock, tmp_path, monkeypatch):
    queue_config(lease_duration=LEASE, max_attempts=5)
    (tmp_path / "counts").mkdir()
    monkeypatch.setenv("COUNTS", str(tmp_path / "counts"))


def write_config(tmp_path: Path, steps: dict) -> Path:
    lines = "\n".join(
        f"      - {json.dumps({'id': ident, **step})}" for ident, step in steps.items()
    )
    path = tmp_path / "apiary.yaml"
    path.write_text(CONFIG.format(steps=lines))
    return path


def make_executor(tmp_path: Path, worker_id: str = "w1", steps: dict = STEPS, history: History | None = None) -> Executor:
    return Executor(
        config=load(write_config(tmp_path, steps)), worker_id=worker_id, history=history or History(),
        groups=ProcessGroups(tmp_path / "run" / worker_id),
    )


def runs(tmp_path: Path, step: str) -> list[str]:
    path = tmp_path / "counts" / step
    return path.read_text().splitlines() if path.exists() else []


def workspace(tmp_path: Path, job: Job) -> Path:
    return tmp_path / ".apiary" / "workspaces" / str(job.payload["task"]["id"])


class Attempt:
    """One claimed attempt of the test's job, and its journal on the in-process transport."""

    def __init__(self, worker_id: str = "w1"):
        self.worker = register(worker_id)
        [self.claim] = claim(self.worker)
        self.cancel = threading.Event()
        self.refused: list[Verdict] = []
        self.journal = Journal(
            transport=InProcessTransport(worker_id=worker_id), claim=self.claim, cancel=self.cancel,
            on_refused=lambda verdict, exc: self.refused.append(verdict), sleep=lambda s: None,
        )

    def run(self, executor: Executor):
        return executor.run(self.claim, self.cancel, grace=GRACE, journal=self.journal)


def expire(clock) -> None:
    """The attempt's worker is gone: its lease runs out and the job is queued again."""
    clock.advance(LEASE + 1)
    services.leases_expire()


def journal_of(job: Job) -> dict:
    return {key: (r.state, r.value) for key, r in services.records_of_job(job.pk).items()}


# --- resumption -----------------------------------------------------------------------------------


def test_a_re_attempt_in_the_same_workspace_skips_recorded_steps_and_reuses_their_outputs(tmp_path, clock):
    """The first attempt is interrupted (the runtime stops it: a self-fence, a lost lease) after
    `pub`; the next one, on the same worker and workspace, resumes at `last`."""
    job = enqueue()
    interrupted = Attempt()
    history = History(on_finished=lambda step_id: step_id == "pub" and interrupted.cancel.set())
    first = interrupted.run(make_executor(tmp_path, history=history))
    assert first.outcome == "cancelled"
    records = journal_of(job)
    assert records["step:plan"] == (
        "done", {"output": "plan-output", "worker_id": "w1", "workspace": str(workspace(tmp_path, job))}
    )
    assert records["publish:pub"] == ("done", {"output": "https://example/pr/1"})
    assert "step:last" not in records

    expire(clock)
    second = Attempt().run(make_executor(tmp_path, history=DatabaseHistory()))  # the embedded worker's history
    assert second.outcome == "succeeded", second.error
    assert runs(tmp_path, "plan") == ["ran"] and len(runs(tmp_path, "pub")) == 1  # only the unrecorded step ran
    assert [(s["id"], s["status"]) for s in second.summary["steps"]] == [
        ("plan", "skipped"), ("pub", "skipped"), ("last", "succeeded")
    ]
    # The skipped steps have history rows, saying why, so status and the admin show them.
    rows = StepRun.objects.filter(instance_id=job.payload["instance_id"], attempt_number=2)
    assert {r.step_id: (r.status, r.output_tail) for r in rows} == {
        "plan": ("skipped", SKIPPED_NOTES["step"]), "pub": ("skipped", SKIPPED_NOTES["publish"]),
        "last": ("succeeded", ""),
    }
    assert all(r.ended_at is not None and r.worker_id == "w1" for r in rows)
    inline = StepRunInline(WorkflowInstance, admin.site)
    shown = [str(inline.output(r)) for r in rows.order_by("id")]  # the admin's output column says why
    assert SKIPPED_NOTES["step"] in shown[0] and SKIPPED_NOTES["publish"] in shown[1]
    assert (workspace(tmp_path, job) / "last.out").read_text() == "https://example/pr/1/plan-output"


def test_a_retry_after_a_failed_run_starts_over_but_never_runs_a_done_publish_again(tmp_path, clock):
    """A run that finished failed is not interrupted work: its retry, even on the same worker and
    workspace, runs every step again, except the done publish (the issue: only an attempt that
    ended without finishing resumes)."""
    job = enqueue()
    (tmp_path / "counts" / "last-fails").touch()
    first = Attempt().run(make_executor(tmp_path))
    assert first.outcome == "failed" and "step last" in first.error
    assert journal_of(job)["retry-after"] == ("started", {"attempt": 1, "run": 1})
    expire(clock)
    (tmp_path / "counts" / "last-fails").unlink()
    second = Attempt().run(make_executor(tmp_path))
    assert second.outcome == "succeeded", second.error
    assert [(s["id"], s["status"]) for s in second.summary["steps"]] == [
        ("plan", "succeeded"), ("pub", "skipped"), ("last", "succeeded")
    ]
    assert runs(tmp_path, "plan") == ["ran", "ran"] and len(runs(tmp_path, "pub")) == 1


def test_only_a_jobs_first_attempt_skips_reading_its_journal_an_operators_retry_reads_it(tmp_path, clock):
    """The journal is written only through a job's attempts, and an operator's retry numbers its
    attempts after the last: attempt 1 finds the journal empty without asking; attempt 2, here the
    retry's, reads it (what it may skip, which run it is)."""
    job = enqueue()
    (tmp_path / "counts" / "last-fails").touch()
    first = Attempt()
    first.journal.records = lambda: pytest.fail("attempt 1 read the journal")
    outcome = first.run(make_executor(tmp_path))
    assert outcome.outcome == "failed" and journal_of(job)["publish:pub"][0] == "done"
    state = services.attempt_finish(
        attempt_id=first.claim.attempt_id, token=first.claim.token, outcome="failed", error=outcome.error
    )
    assert state == "failed"
    services.job_retry(job_id=job.pk)
    (tmp_path / "counts" / "last-fails").unlink()
    second = Attempt()
    assert second.claim.attempt_number == 2
    reads, read = [], second.journal.records
    second.journal.records = lambda: reads.append("read") or read()
    assert second.run(make_executor(tmp_path)).outcome == "succeeded"
    assert reads == ["read"] and len(runs(tmp_path, "pub")) == 1


def test_a_re_attempt_on_another_worker_starts_over_but_never_runs_a_done_publish_again(tmp_path, clock):
    job = enqueue()
    (tmp_path / "counts" / "last-fails").touch()
    assert Attempt("w1").run(make_executor(tmp_path, "w1")).outcome == "failed"
    expire(clock)
    (tmp_path / "counts" / "last-fails").unlink()

    history = History()
    second = Attempt("w2").run(make_executor(tmp_path, "w2", history=history))
    assert second.outcome == "succeeded", second.error
    assert history.rows == {"plan": "succeeded", "pub": "skipped", "last": "succeeded"}
    assert history.notes["pub"] == SKIPPED_NOTES["publish"]
    assert runs(tmp_path, "plan") == ["ran", "ran"]  # another worker's record: run again
    assert len(runs(tmp_path, "pub")) == 1  # the done publish: never again, anywhere
    assert (workspace(tmp_path, job) / "last.out").read_text() == "https://example/pr/1/plan-output"
    assert journal_of(job)["step:plan"][1]["worker_id"] == "w1"  # done is final: the first record stands
    assert [(s["id"], s["status"]) for s in second.summary["steps"]][1] == ("pub", "skipped")


FOUR_STEPS = {
    name: {"run": f'echo "$APIARY_ATTEMPT" >> "$COUNTS/{name}"; test ! -f "$COUNTS/{name}-fails" || exit 3; printf {name}-$APIARY_ATTEMPT'}
    for name in ("a", "b", "c", "d")
}


def interrupted_after(step_id: str, worker_id: str = "w1") -> tuple[Attempt, History]:
    """An attempt that the runtime stops (a lost lease, a self-fence) once `step_id` has finished."""
    attempt = Attempt(worker_id)
    return attempt, History(on_finished=lambda finished: finished == step_id and attempt.cancel.set())


def test_after_a_failed_run_the_retry_records_its_own_steps_and_a_later_interruption_resumes_from_them(tmp_path, clock):
    """Attempt 1 fails at c; its retry (attempt 2, a new run) runs a, b, c and is interrupted after
    c; attempt 3 on the same worker resumes at d with run 2's outputs, not run 1's."""
    job = enqueue()
    (tmp_path / "counts" / "c-fails").touch()
    assert Attempt().run(make_executor(tmp_path, steps=FOUR_STEPS)).outcome == "failed"
    expire(clock)
    (tmp_path / "counts" / "c-fails").unlink()
    second, history = interrupted_after("c")
    assert second.run(make_executor(tmp_path, steps=FOUR_STEPS, history=history)).outcome == "cancelled"
    expire(clock)

    third = Attempt().run(make_executor(tmp_path, steps=FOUR_STEPS))
    assert third.outcome == "succeeded", third.error
    assert [(s["id"], s["status"]) for s in third.summary["steps"]] == [
        ("a", "skipped"), ("b", "skipped"), ("c", "skipped"), ("d", "succeeded")
    ]
    assert [runs(tmp_path, name) for name in ("a", "b", "c", "d")] == [["1", "2"], ["1", "2"], ["1", "2"], ["3"]]
    assert journal_of(job)["step:b:1"][1]["output"] == "b-2"  # the retry's own record; step:b is run 0's


def test_resumption_is_a_prefix_once_a_step_runs_every_plain_step_after_it_runs_too(tmp_path, clock):
    """w1 records a and is interrupted; attempt 2 on w2 runs a (w1's record is not its) and b, and is
    interrupted; attempt 3 on w2 must run a, and so b again: b's input may have changed."""
    enqueue()
    first, history = interrupted_after("a", "w1")
    first.run(make_executor(tmp_path, "w1", steps=FOUR_STEPS, history=history))
    expire(clock)
    second, history = interrupted_after("b", "w2")
    second.run(make_executor(tmp_path, "w2", steps=FOUR_STEPS, history=history))
    expire(clock)

    third = Attempt("w2").run(make_executor(tmp_path, "w2", steps=FOUR_STEPS))
    assert third.outcome == "succeeded", third.error
    assert [s["status"] for s in third.summary["steps"]] == ["succeeded"] * 4
    assert runs(tmp_path, "b") == ["2", "3"]


# --- publish ----------------------------------------------------------------------------------------


def test_a_publish_an_earlier_attempt_started_runs_again_with_the_same_key_and_effect_retry(tmp_path, clock):
    """The first attempt's worker died mid-publish: it had recorded `started` (as the executor does
    right before the command) and nothing after, so the publish's end is unknown."""
    job = enqueue()
    first = Attempt()
    first.journal.record("publish:pub", "started", {})
    expire(clock)

    assert Attempt("w2").run(make_executor(tmp_path, "w2")).outcome == "succeeded"
    key = payload.step_effect_key(project="effects", job=payload.read(_claim_of(job)), step_id="pub")
    assert runs(tmp_path, "pub") == [f"{key}|1"]
    assert journal_of(job)["publish:pub"] == ("done", {"output": "https://example/pr/1"})


def test_a_publish_that_exited_non_zero_runs_again_in_the_retry_without_the_retry_flag(tmp_path, clock):
    """Its end is known (it failed), so the retry's run of it is no retry of an unknown end."""
    job = enqueue()
    (tmp_path / "counts" / "pub-fails").touch()
    assert Attempt().run(make_executor(tmp_path)).outcome == "failed"
    assert journal_of(job)["publish:pub"] == ("started", {"exited": 1})
    expire(clock)
    (tmp_path / "counts" / "pub-fails").unlink()

    assert Attempt().run(make_executor(tmp_path)).outcome == "succeeded"
    key = payload.step_effect_key(project="effects", job=payload.read(_claim_of(job)), step_id="pub")
    assert runs(tmp_path, "pub") == [f"{key}|", f"{key}|"]


def _claim_of(job: Job) -> Claim:
    return Claim(job.pk, 0, 1, "", None, "sh", "shell", job.payload)


def test_effect_keys_differ_between_steps_instances_and_projects():
    job = payload.WorkflowJob(workflow="fix", instance_id=1, task={"id": 3, "generation": 2})
    key = payload.step_effect_key(project="p", job=job, step_id="pub")
    assert key == payload.step_effect_key(project="p", job=dataclass_copy(job, instance_id=1), step_id="pub")
    assert key != payload.step_effect_key(project="p", job=job, step_id="other")
    assert key != payload.step_effect_key(project="q", job=job, step_id="pub")
    assert key != payload.step_effect_key(project="p", job=dataclass_copy(job, task={"id": 3, "generation": 3}), step_id="pub")


def dataclass_copy(job, **changes):
    return dataclasses.replace(job, **changes)


@pytest.mark.parametrize("lost", ["during the first step", "after the first step was recorded"])
def test_a_stale_attempt_runs_no_publish_and_records_nothing(tmp_path, clock, lost):
    """The worker pauses past its lease (SIGSTOP) and goes on: the next journal call is refused."""
    job = enqueue()

    def during_step(step_id):
        if lost == "during the first step" and step_id == "plan":
            expire(clock)

    attempt = Attempt()
    record = attempt.journal.record

    def record_then_pause(key, state, value):
        written = record(key, state, value)
        if lost == "after the first step was recorded" and key == "step:plan":
            expire(clock)
        return written

    attempt.journal.record = record_then_pause
    outcome = attempt.run(make_executor(tmp_path, history=History(on_finished=during_step)))
    assert outcome.outcome == "failed" and "no longer current" in outcome.error
    assert runs(tmp_path, "plan") == ["ran"] and runs(tmp_path, "pub") == []  # the publish never ran
    recorded = {"during the first step": set(), "after the first step was recorded": {"step:plan"}}[lost]
    assert set(journal_of(job)) == recorded  # nothing recorded once stale: no publish start, no success
    assert attempt.refused == [Verdict.STALE]  # the runtime was told: it discards the result


# --- spawn ------------------------------------------------------------------------------------------

CHILDREN = [
    {"id": "part-1", "title": "First part", "body": "do this", "payload": {"n": 1}, "workflows": ["triage"]},
    {"id": "part-2", "title": "Second part"},
]
SPAWN_STEPS = {
    "split": {"run": f'echo ran >> "$COUNTS/split"; printf "%s\\n\\n%s\\n" {json.dumps(json.dumps(CHILDREN[0]))} '
              f'{json.dumps(json.dumps(CHILDREN[1]))}', "spawn": True},
    "last": {"run": 'test ! -f "$COUNTS/last-fails"'},
}


def test_a_spawn_steps_children_are_validated_and_recorded_once(tmp_path, clock):
    job = enqueue()
    (tmp_path / "counts" / "last-fails").touch()
    assert Attempt("w1").run(make_executor(tmp_path, "w1", steps=SPAWN_STEPS)).outcome == "failed"
    assert journal_of(job)["spawn:split"] == ("done", {"children": CHILDREN})
    expire(clock)
    (tmp_path / "counts" / "last-fails").unlink()

    outbox = LocalDB(tmp_path / "w2.db")  # a remote worker's history
    second = Attempt("w2")
    assert second.run(make_executor(tmp_path, "w2", steps=SPAWN_STEPS, history=outbox)).outcome == "succeeded"
    assert runs(tmp_path, "split") == ["ran"]  # a done spawn is not run again, in any workspace
    rows = outbox.db.execute("SELECT step_id, status, output_tail FROM step_runs WHERE job_id = ?", (job.pk,))
    assert ("split", "skipped", SKIPPED_NOTES["spawn"]) in rows.fetchall()
    outbox.close()
    assert journal_of(job)["spawn:split"] == ("done", {"children": CHILDREN})


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (['{"id": "a", "title": "A"}', "not json"], "line 2: not JSON"),
        (['{"id": "a b", "title": "A"}'], "line 1: id must be"),
        (['{"id": "a", "title": ""}'], "line 1: title must be"),
        (['{"id": "a", "title": "' + "x" * 501 + '"}'], "line 1: title must be"),
        (['{"id": "a", "title": "A", "body": 3}'], "line 1: body must be a string"),
        (['{"id": "a", "title": "A", "payload": []}'], "line 1: payload must be a JSON object"),
        (['{"id": "a", "title": "A", "workflows": "triage"}'], "line 1: workflows must be a list"),
        (['{"id": "a", "title": "A", "extra": 1}'], "line 1: unknown key 'extra'"),
        (['{"id": "a", "title": "A"}', '{"id": "a", "title": "B"}'], "line 2: id 'a' is already on line 1"),
        (['[1]'], "line 1: expected a JSON object"),
        ([json.dumps({"id": f"c{n}", "title": "t"}) for n in range(101)], "line 101: more than 100 children"),
    ],
)  # fmt: skip
def test_a_bad_spawn_line_fails_the_step_naming_the_line_and_spawns_nothing(tmp_path, clock, lines, error):
    job = enqueue()
    (tmp_path / "lines").write_text("\n".join(lines) + "\n")
    steps = {"split": {"run": f"cat {tmp_path / 'lines'}", "spawn": True}}
    outcome = Attempt().run(make_executor(tmp_path, steps=steps))
    assert outcome.outcome == "failed" and error in outcome.error, outcome.error
    assert journal_of(job) == {"retry-after": ("started", {"attempt": 1, "run": 1})}  # nothing spawned; a retry starts over


def test_a_long_output_is_cut_to_fit_one_record_with_a_note():
    value = effects.with_output({"worker_id": "w1"}, '"' * 70_000)  # each quote takes two bytes in JSON
    assert effects.json_size(value) <= effects.MAX_RECORD_VALUE_BYTES
    assert value["output"].endswith("see the step log]") and "70000 bytes in all" in value["output"]


# --- checkpoints ------------------------------------------------------------------------------------

CHECKPOINT_STEPS = {
    "long": {
        "run": 'printf "%s:" "$${APIARY_RESUMED:-0}" >> "$COUNTS/long"; cat "$APIARY_CHECKPOINT" >> "$COUNTS/long" '
        '2>/dev/null; echo >> "$COUNTS/long"; printf "turn 3" > "$APIARY_CHECKPOINT"; touch "$COUNTS/written"; '
        'while [ ! -f "$COUNTS/go" ]; do sleep 0.02; done'
    },
}


class FakeMonotonic:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.django_db(transaction=True)
def test_a_checkpoint_rides_a_heartbeat_and_the_next_attempt_starts_from_it_resumed(tmp_path, clock):
    job = enqueue()
    executor = make_executor(tmp_path, steps=CHECKPOINT_STEPS)
    spec = WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=("apiary.hooks", "apiary.workflow", "runner:shell"), capacity=1)
    runtime = WorkerRuntime(
        transport=InProcessTransport(worker_id="w1"), spec=spec, executor=executor, claim_wait=0.0,
        monotonic=FakeMonotonic(), grace=GRACE,
    )
    runtime.start()
    try:
        assert runtime.claim_once() == 1
        wait_for((tmp_path / "counts" / "written").exists, timeout=WAIT, what="the step to write its checkpoint")
        runtime.monotonic.now += runtime.beat_every
        runtime.heartbeat_once()
        assert journal_of(job)["checkpoint:long"] == ("started", {"content": "turn 3"})
    finally:
        with runtime.lock:
            active = list(runtime.active.values())
        for held in active:  # the worker dies
            held.discard = "test: the worker died"
            held.cancel.set()
        runtime.reap(wait=True)
    expire(clock)
    (tmp_path / "counts" / "go").touch()
    (tmp_path / ".apiary" / "logs" / str(job.payload["instance_id"]) / "long.checkpoint").write_text("a local leftover")

    assert Attempt().run(make_executor(tmp_path, steps=CHECKPOINT_STEPS)).outcome == "succeeded"
    assert runs(tmp_path, "long") == ["0:", "1:turn 3"]  # pre-filled from the journal, APIARY_RESUMED=1


def test_a_failed_steps_checkpoint_is_sent_as_it_ends_and_its_next_attempt_starts_from_it(tmp_path, clock):
    job = enqueue()
    steps = {
        "long": {
            "run": 'printf "%s:%s\\n" "$${APIARY_RESUMED:-0}" "$(cat "$APIARY_CHECKPOINT" 2>/dev/null)" >> "$COUNTS/long"; '
            'printf "turn 7" > "$APIARY_CHECKPOINT"; test -f "$COUNTS/go"'
        }
    }
    assert Attempt().run(make_executor(tmp_path, steps=steps)).outcome == "failed"  # no heartbeat came due
    assert journal_of(job)["checkpoint:long"] == ("started", {"content": "turn 7"})
    expire(clock)
    (tmp_path / "counts" / "go").touch()
    assert Attempt().run(make_executor(tmp_path, steps=steps)).outcome == "succeeded"
    assert runs(tmp_path, "long") == ["0:", "1:turn 7"]


def test_a_checkpoint_of_a_step_that_then_succeeded_is_not_pre_filled_when_the_step_runs_again(tmp_path, clock):
    """w1 kept a checkpoint of `session`, which then succeeded, and was interrupted after it; on w2
    the step runs again (w1's success is not w2's) as a fresh session, not a resumed one."""
    job = enqueue()
    steps = {
        "session": {"run": 'printf "%s:%s\\n" "$${APIARY_RESUMED:-0}" "$(cat "$APIARY_CHECKPOINT" 2>/dev/null)" >> "$COUNTS/s"'},
        "after": {"run": "true"},
    }
    first = Attempt("w1")

    def kept_then_interrupted(finished: str) -> None:
        if finished == "session":  # what a heartbeat carried while the step ran, before its success
            services.attempt_heartbeat_with_checkpoint(
                attempt_id=first.claim.attempt_id, token=first.claim.token, step="session", content="turn 9"
            )
            first.cancel.set()

    first.run(make_executor(tmp_path, "w1", steps=steps, history=History(on_finished=kept_then_interrupted)))
    assert journal_of(job)["step:session"][0] == "done" and journal_of(job)["checkpoint:session"][0] == "started"
    expire(clock)

    assert Attempt("w2").run(make_executor(tmp_path, "w2", steps=steps)).outcome == "succeeded"
    assert runs(tmp_path, "s") == ["0:", "0:"]


def test_a_spawn_recorded_by_a_worker_that_died_before_its_step_record_is_skipped_with_the_childrens_lines(
    tmp_path, clock
):
    job = enqueue()
    steps = {"split": {"run": "echo ran >> \"$COUNTS/split\"", "spawn": True}, "show": {"run": "printf %s {{ steps.split.output }} > show.out"}}
    first = Attempt()
    first.journal.record("spawn:split", "done", {"children": [{"id": "c1", "title": "One"}]})  # then it died
    expire(clock)
    assert Attempt().run(make_executor(tmp_path, steps=steps)).outcome == "succeeded"
    assert runs(tmp_path, "split") == []
    assert json.loads((workspace(tmp_path, job) / "show.out").read_text()) == {"id": "c1", "title": "One"}


# --- hooks ------------------------------------------------------------------------------------------


def hook_claim(job: Job, outcome: str) -> Claim:
    hook = {"outcome": outcome, "effect_key": "hookkey123"}
    return Claim(job.pk, 0, 1, "", None, "sh", "shell", {**job.payload, "hook": hook})


def test_a_hook_job_runs_its_outcomes_steps_with_the_hook_environment_and_not_the_workflows(tmp_path):
    job = enqueue()
    history = History()
    outcome = make_executor(tmp_path, history=history).run(hook_claim(job, "succeeded"), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", outcome.error
    assert history.rows == {"hook:succeeded:hook-1": "succeeded"}  # apart from the instance's step rows
    assert (workspace(tmp_path, job) / "hook.out").read_text() == "succeeded hookkey123 hook-1"
    assert runs(tmp_path, "plan") == [] and runs(tmp_path, "pub") == []


def test_a_failing_hook_fails_its_own_job(tmp_path):
    job = enqueue()
    outcome = make_executor(tmp_path).run(hook_claim(job, "failed"), threading.Event(), grace=GRACE)
    assert outcome.outcome == "failed" and "step hook-1 exited with 4" in outcome.error
    assert [s["id"] for s in outcome.summary["steps"]] == ["hook:failed:hook-1"]


def test_a_hook_the_config_no_longer_has_runs_nothing(tmp_path):
    job = enqueue()
    outcome = make_executor(tmp_path).run(hook_claim(job, "cancelled"), threading.Event(), grace=GRACE)
    assert (outcome.outcome, outcome.summary["steps"]) == ("succeeded", [])


def hook_job(outcome: str = "succeeded") -> Job:
    """A hook job as dispatch makes it (its own job, journal and attempts)."""
    job = enqueue()
    hook = {"outcome": outcome, "effect_key": "hookkey123"}
    Job.objects.filter(pk=job.pk).update(payload={**job.payload, "hook": hook})
    return job


def test_a_hook_step_done_on_a_worker_that_died_never_runs_again_anywhere(tmp_path, clock):
    """Each hook step is recorded like a publish: the attempt that dies after `tell` succeeded is
    followed, on another worker, by one that skips it and runs only `hold`."""
    path = write_config(tmp_path, {"plan": {"run": "true"}})
    path.write_text(path.read_text().replace(
        "      on_success: [",
        '      on_success: [{id: tell, run: \'echo "$APIARY_EFFECT_KEY|$${APIARY_EFFECT_RETRY:-}" >> "$COUNTS/tell"\'},'
        ' {id: hold, run: \'echo ran >> "$COUNTS/hold"\'}, ',
    ))
    config = load(path)
    job = hook_job()
    interrupted = Attempt("w1")
    history = History(on_finished=lambda step_id: step_id == "hook:succeeded:tell" and interrupted.cancel.set())
    executor = Executor(config=config, worker_id="w1", history=history, groups=ProcessGroups(tmp_path / "run" / "w1"))
    assert interrupted.run(executor).outcome == "cancelled"
    assert journal_of(job)["publish:tell"] == ("done", {"output": ""})
    expire(clock)

    history = History()
    executor = Executor(config=config, worker_id="w2", history=history, groups=ProcessGroups(tmp_path / "run" / "w2"))
    second = Attempt("w2").run(executor)
    assert second.outcome == "succeeded", second.error
    assert history.rows == {"hook:succeeded:tell": "skipped", "hook:succeeded:hook-3": "succeeded",
                            "hook:succeeded:hold": "succeeded"}
    assert history.notes["hook:succeeded:tell"] == SKIPPED_NOTES["hook"]
    assert runs(tmp_path, "tell") == ["hookkey123|"]  # once in all, though the second attempt ran elsewhere
    assert runs(tmp_path, "hold") == ["ran"]  # the first attempt was stopped before it


def test_a_hook_step_id_leaves_room_for_its_history_id(tmp_path):
    steps = {"plan": {"run": "true"}}
    path = write_config(tmp_path, steps)
    path.write_text(path.read_text().replace("[{run: \"exit 4\"}]", "[{id: " + "h" * 114 + ", run: \"exit 4\"}]"))
    with pytest.raises(ConfigError, match=r"hooks.on_failure\[0\].id: a hook step id is at most 113 characters"):
        load(path)


def test_without_a_journal_a_publish_step_is_refused_and_plain_steps_run(tmp_path, clock):
    """A control plane from before effect steps lists no `journal` feature: the runtime gives the
    executor no journal, and a publish (or spawn) step then fails, saying so, instead of running
    unrecorded (and again on every retry)."""
    enqueue()
    [c] = claim(register("w1"))
    outcome = make_executor(tmp_path).run(c, threading.Event(), grace=GRACE, journal=None)
    assert outcome.outcome == "failed" and "upgrade the control plane" in outcome.error
    assert runs(tmp_path, "plan") == ["ran"] and runs(tmp_path, "pub") == []

"""The executor that runs a job's steps: what a step's environment holds and
what happens when a step cannot start.

Secrets of the worker process never reach a step. Task text that an
environment cannot hold (NUL, lone surrogates, more than execve takes) still
lets every step start: the variables are cleaned and capped, and the whole
task is in a file. A step that cannot be started is recorded as failed, never
left `running`.
"""

import datetime as dt
import json
import threading
from pathlib import Path

import pytest

from jobqueue.text import clean
from jobqueue.types import Claim
from workers.pgroups import ProcessGroups
from workflows import executor as executor_module
from workflows import payload
from workflows.config import load
from workflows.executor import TASK_TEXT_CAP, WITHHELD_ENV, Executor, task_environment

STEP_CONFIG = """
project: review
agents:
  - id: sh
    runner: shell
    command: cat
workflows:
  - id: job
    agent: sh
    steps:
{steps}
"""


class History:
    """Step history as the executor reports it: step id → status ("running" until finished)."""

    def __init__(self):
        self.rows: dict[str, str] = {}
        self.results: dict = {}

    def step_started(self, *, claim, worker_id, step_id, started_at, log_path):
        self.rows[step_id] = "running"

    def step_finished(self, *, claim, worker_id, step_id, result):
        self.rows[step_id] = result.status
        self.results[step_id] = result


def make_claim(task: dict, *, attempt: int = 1, instance: int = 5) -> Claim:
    return Claim(
        job_id=1, attempt_id=1, attempt_number=attempt, token="t", lease_expires_at=dt.datetime.now(dt.UTC),
        agent="sh", runner="shell", payload={"workflow": "job", "instance_id": instance, "task": task},
    )


GRACE = 0.5


def environment_of(task: dict, **kwargs) -> dict[str, str]:
    """task_environment for a claim of `task`, with the workflow job read from its payload."""
    c = make_claim(task)
    job = payload.read(c)
    return task_environment(c, job, task=clean(dict(job.task)), **kwargs)


def make_executor(tmp_path: Path, *steps: str, groups: ProcessGroups | None = None) -> Executor:
    lines = "\n".join(f"      - id: s{n}\n        run: {json.dumps(run)}" for n, run in enumerate(steps, start=1))
    (tmp_path / "apiary.yaml").write_text(STEP_CONFIG.format(steps=lines))
    return Executor(
        config=load(tmp_path / "apiary.yaml"), worker_id="w1", history=History(),
        groups=groups or ProcessGroups(tmp_path / "run"),
    )


def workspace_file(tmp_path: Path, task_id: int, name: str) -> bytes:
    return (tmp_path / ".apiary" / "workspaces" / str(task_id) / name).read_bytes()


# --- secrets ---------------------------------------------------------------------------------------


def test_worker_secrets_in_the_workers_environment_do_not_reach_steps(tmp_path, monkeypatch):
    assert set(WITHHELD_ENV) == {"APIARY_WORKER_TOKEN", "DATABASE_URL", "DJANGO_SECRET_KEY", "PROMETHEUS_MULTIPROC_DIR"}
    monkeypatch.setenv("APIARY_WORKER_TOKEN", "CANARY-token")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/CANARY-metrics")  # the daemon's metric files (jobqueue.metrics)
    monkeypatch.setenv("DATABASE_URL", "postgres://apiary:CANARY-password@db/apiary")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "CANARY-secret-key")
    monkeypatch.setenv("REVIEW_ORDINARY_VARIABLE", "still-passed")  # the rest of the environment still goes
    ex = make_executor(tmp_path, "env > env.txt")
    outcome = ex.run(make_claim({"id": 7, "title": "t"}), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", outcome
    names = {line.split("=", 1)[0] for line in workspace_file(tmp_path, 7, "env.txt").decode().splitlines()}
    assert "REVIEW_ORDINARY_VARIABLE" in names
    assert not names & set(WITHHELD_ENV)
    assert b"CANARY" not in workspace_file(tmp_path, 7, "env.txt")


# --- task text an environment cannot hold ------------------------------------------------------------


def test_nul_in_task_text_is_replaced_and_every_step_runs(tmp_path):
    ex = make_executor(
        tmp_path,
        'printf %s "$APIARY_TASK_TITLE|$APIARY_TASK_BODY|$APIARY_TASK_PAYLOAD" > env.out',
        "printf %s {{ task.title }} > template.out",
    )
    task = {"id": 9, "title": "a\x00b", "body": "c\x00d", "payload": {"k\x00": "v\x00"}}
    outcome = ex.run(make_claim(task), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", outcome
    assert ex.history.rows == {"s1": "succeeded", "s2": "succeeded"}
    title, body, payload = workspace_file(tmp_path, 9, "env.out").decode().split("|")
    assert (title, body) == ("a\ufffdb", "c\ufffdd")
    assert json.loads(payload) == {"k\ufffd": "v\ufffd"}
    assert workspace_file(tmp_path, 9, "template.out").decode() == "a\ufffdb"


def test_a_lone_surrogate_in_task_text_reaches_steps_as_replacement_and_the_file_keeps_it(tmp_path):
    # JSON from a remote source may carry "\ud800"; it cannot be encoded into an environment.
    ex = make_executor(tmp_path, 'printf %s "$APIARY_TASK_TITLE" > title.out; cp "$APIARY_TASK_FILE" task.json')
    task = {"id": 14, "title": "a\ud800b", "body": "nul\x00"}
    assert ex.run(make_claim(task), threading.Event(), grace=GRACE).outcome == "succeeded"
    assert workspace_file(tmp_path, 14, "title.out").decode() == "a\ufffdb"
    assert json.loads(workspace_file(tmp_path, 14, "task.json")) == task  # the file has the task exactly


def test_a_prompt_larger_than_execve_takes_reaches_a_shell_agent_whole_on_stdin(tmp_path):
    (tmp_path / "apiary.yaml").write_text(
        "project: review\n"
        "agents: [{id: sh, runner: shell, command: 'cat > prompt.out; printf %s \"$APIARY_PROMPT\" > env.out'}]\n"
        "workflows: [{id: job, agent: sh, steps: [{id: p, prompt: 'Do: {{ task.body }}'}]}]\n"
    )
    ex = Executor(config=load(tmp_path / "apiary.yaml"), worker_id="w1", history=History(),
                  groups=ProcessGroups(tmp_path / "run"))
    body = "z" * 140_000
    outcome = ex.run(make_claim({"id": 15, "title": "t", "body": body}), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", (outcome.error, outcome.summary)
    assert workspace_file(tmp_path, 15, "prompt.out").decode() == "Do: " + body
    env_copy = workspace_file(tmp_path, 15, "env.out")
    assert len(env_copy) <= TASK_TEXT_CAP and b"truncated" in env_copy and b"stdin" in env_copy


def test_a_task_body_larger_than_execve_takes_still_runs_every_step(tmp_path):
    body = "x" * 140_000  # one environment string may be at most 128 KiB (MAX_ARG_STRLEN)
    ex = make_executor(
        tmp_path,
        'printf %s "$APIARY_TASK_BODY" > body.out; printf %s "$APIARY_TASK_PAYLOAD" > payload.out',
        'cp "$APIARY_TASK_FILE" task.json',
    )
    task = {"id": 10, "title": "t", "body": body, "payload": {"body": body}}
    outcome = ex.run(make_claim(task), threading.Event(), grace=GRACE)
    assert outcome.outcome == "succeeded", (outcome.error, outcome.summary)
    for name in ("body.out", "payload.out"):
        value = workspace_file(tmp_path, 10, name)
        assert len(value) <= TASK_TEXT_CAP
        assert b"truncated" in value and b"APIARY_TASK_FILE" in value
    assert workspace_file(tmp_path, 10, "body.out").startswith(b"x" * 30_000)
    assert json.loads(workspace_file(tmp_path, 10, "task.json")) == task


def test_truncation_cuts_at_a_utf8_character_boundary(tmp_path):
    body = "é" * 40_000  # two bytes each; the cap is even, so shift by one byte to land mid-character
    env = environment_of(
        {"id": 1, "body": "a" + body, "payload": {}},
        worker_id="w1", workspace=tmp_path, task_file=tmp_path / "task.json",
    )
    value = env["APIARY_TASK_BODY"]
    assert len(value.encode("utf-8")) <= TASK_TEXT_CAP
    kept = value[: value.index("é\n") + 1] if "é\n" in value else value
    assert ("a" + body).startswith(kept) and len(kept) > TASK_TEXT_CAP // 2 - 100
    assert "truncated" in value
    assert env["APIARY_TASK_FILE"] == str(tmp_path / "task.json")
    short = environment_of({"id": 1, "body": "short"}, worker_id="w1", workspace=tmp_path,
                           task_file=tmp_path / "task.json")
    assert short["APIARY_TASK_BODY"] == "short"


def test_the_task_file_is_written_before_the_first_step_for_each_attempt(tmp_path):
    ex = make_executor(tmp_path, 'cp "$APIARY_TASK_FILE" seen.json; echo "$APIARY_TASK_FILE" > path.txt')
    task = {"id": 11, "title": "T", "body": "B", "payload": {"n": 1}, "source": "inbox", "item_key": "a.md"}
    assert ex.run(make_claim(task, attempt=2, instance=8), threading.Event(), grace=GRACE).outcome == "succeeded"
    path = Path(workspace_file(tmp_path, 11, "path.txt").decode().strip())
    assert path == tmp_path / ".apiary" / "logs" / "8" / "task-2.json"
    assert json.loads(workspace_file(tmp_path, 11, "seen.json")) == task


def test_a_job_makes_two_directories_its_workspace_and_its_logs_which_hold_its_checkpoints(tmp_path):
    """Each new inode costs: on a file system without a journal (ext4 skips inodes freed in the
    last half minute) a directory costs a hundred microseconds of CPU and more."""
    ex = make_executor(tmp_path, 'echo "$APIARY_CHECKPOINT" > checkpoint.txt')
    task = {"id": 11, "title": "T", "body": "B", "source": "inbox", "item_key": "a.md"}
    assert ex.run(make_claim(task, instance=8), threading.Event(), grace=GRACE).outcome == "succeeded"
    state = tmp_path / ".apiary"
    made = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_dir())
    assert made == ["logs", "logs/8", "workspaces", "workspaces/11"]
    assert workspace_file(tmp_path, 11, "checkpoint.txt").decode().strip() == str(state / "logs" / "8" / "s1.checkpoint")


def test_a_checkpoint_file_left_by_an_earlier_step_is_gone_when_the_next_step_starts(tmp_path):
    # The first step of a job whose logs folder is new skips the removal (the folder is empty);
    # every later step still removes what is there.
    ex = make_executor(
        tmp_path,
        'echo planted > "$(dirname "$APIARY_CHECKPOINT")/s2.checkpoint"',
        'test ! -e "$APIARY_CHECKPOINT" && echo absent > s2.txt',
    )
    assert ex.run(make_claim({"id": 13, "title": "t"}, instance=9), threading.Event(), grace=GRACE).outcome == "succeeded"
    assert workspace_file(tmp_path, 13, "s2.txt") == b"absent\n"
    # The next attempt finds the folder there: its first step's stale checkpoint file goes too.
    (tmp_path / ".apiary" / "logs" / "9" / "s1.checkpoint").write_text("stale")
    ex = make_executor(tmp_path, 'test ! -e "$APIARY_CHECKPOINT" && echo absent > s1.txt')
    assert ex.run(make_claim({"id": 13, "title": "t"}, instance=9, attempt=2), threading.Event(), grace=GRACE).outcome == "succeeded"
    assert workspace_file(tmp_path, 13, "s1.txt") == b"absent\n"


# --- a step that cannot be started ------------------------------------------------------------------


def test_an_error_while_starting_a_step_is_recorded_as_a_failed_step(tmp_path, monkeypatch):
    ex = make_executor(tmp_path, "true", "true")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executor_module.runners, "run_step", boom)
    outcome = ex.run(make_claim({"id": 12, "title": "t"}), threading.Event(), grace=GRACE)
    assert ex.history.rows == {"s1": "failed"}  # finished, not left running; s2 never started
    assert outcome.outcome == "failed" and "s1" in outcome.error
    assert "No space left on device" in ex.history.results["s1"].output_tail


def test_a_step_whose_process_group_cannot_be_recorded_is_recorded_as_failed(tmp_path):
    # A real failure inside run_step after the process started: the group record cannot be written.
    groups = ProcessGroups(tmp_path / "run")
    (tmp_path / "run").rmdir()
    ex = make_executor(tmp_path, "echo started > started.txt; sleep 30", groups=groups)
    outcome = ex.run(make_claim({"id": 13, "title": "t"}), threading.Event(), grace=GRACE)
    assert ex.history.rows == {"s1": "failed"}
    assert outcome.outcome == "failed"


@pytest.mark.parametrize("name", ["APIARY_TASK_TITLE", "APIARY_TASK_BODY", "APIARY_TASK_ITEM_KEY"])
def test_every_task_variable_is_capped(tmp_path, name):
    huge = "y" * 200_000
    task = {"id": 1, "title": huge, "body": huge, "item_key": huge, "payload": {}}
    env = environment_of(task, worker_id="w1", workspace=tmp_path, task_file=tmp_path / "t.json")
    assert len(env[name].encode()) <= TASK_TEXT_CAP

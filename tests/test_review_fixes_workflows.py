"""Regression tests for review findings in the executor and the control plane.

Executor: secrets of the worker process never reach a step; task text that an
environment cannot hold (NUL, more than execve takes) still lets every step
start, and the whole task is in a file; a step that cannot be started is
recorded as failed, never left `running`.
"""

import datetime as dt
import json
import threading
from pathlib import Path

from jobqueue.services import Claim
from workers.executor import WITHHELD_ENV, Executor
from workers.pgroups import ProcessGroups
from workflows.config import load

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
        workflow="job", instance_id=instance, agent="sh", runner="shell", task=task,
    )


def make_executor(tmp_path: Path, *steps: str, groups: ProcessGroups | None = None) -> Executor:
    lines = "\n".join(f"      - id: s{n}\n        run: {json.dumps(run)}" for n, run in enumerate(steps, start=1))
    (tmp_path / "apiary.yaml").write_text(STEP_CONFIG.format(steps=lines))
    return Executor(
        config=load(tmp_path / "apiary.yaml"), worker_id="w1", history=History(),
        groups=groups or ProcessGroups(tmp_path / "run"), grace=0.5,
    )


def workspace_file(tmp_path: Path, task_id: int, name: str) -> bytes:
    return (tmp_path / ".apiary" / "workspaces" / str(task_id) / name).read_bytes()


# --- secrets ---------------------------------------------------------------------------------------


def test_worker_secrets_in_the_workers_environment_do_not_reach_steps(tmp_path, monkeypatch):
    assert set(WITHHELD_ENV) == {"APIARY_WORKER_TOKEN", "DATABASE_URL", "DJANGO_SECRET_KEY"}
    monkeypatch.setenv("APIARY_WORKER_TOKEN", "CANARY-token")
    monkeypatch.setenv("DATABASE_URL", "postgres://apiary:CANARY-password@db/apiary")
    monkeypatch.setenv("DJANGO_SECRET_KEY", "CANARY-secret-key")
    monkeypatch.setenv("REVIEW_ORDINARY_VARIABLE", "still-passed")  # the rest of the environment still goes
    ex = make_executor(tmp_path, "env > env.txt")
    outcome = ex.run(make_claim({"id": 7, "title": "t"}), threading.Event())
    assert outcome.outcome == "succeeded", outcome
    names = {line.split("=", 1)[0] for line in workspace_file(tmp_path, 7, "env.txt").decode().splitlines()}
    assert "REVIEW_ORDINARY_VARIABLE" in names
    assert not names & set(WITHHELD_ENV)
    assert b"CANARY" not in workspace_file(tmp_path, 7, "env.txt")

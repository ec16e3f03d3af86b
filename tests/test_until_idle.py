"""`apiary run --until-idle` ends on its own: 0 when the work is done, 3 when
what is left can never run as configured (instead of waiting forever)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
agents:
  - id: builder
    runner: shell
    command: cat
    worker_pool: build
workflows:
  - id: build
    agent: builder
    steps:
      - id: s
        run: echo hi
sources:
  - id: inbox
    type: directory
    path: tasks
    poll_interval: 1s
    workflows: [build]
"""


@pytest.mark.processes
def test_until_idle_exits_3_naming_jobs_no_worker_can_take(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "a.md").write_text("# a task\n")
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    run = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runapiary", "--config", str(tmp_path / "apiary.yaml"), "--until-idle"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert run.returncode == 3, run.stderr
    assert "blocked: job 1: no worker in pool build" in run.stderr

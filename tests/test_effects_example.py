"""examples/effects/ end to end: `apiary run --until-idle` on a copy runs the
release workflow's publish once, its spawn's children (each running the
`chore` workflow) and its success hook once; a second run does none of it again.

Real processes (tests/daemon.py), as tests/test_local_mode.py runs examples/hello."""

import json
import shutil

import pytest

from tests.daemon import REPO, Database, run

pytestmark = pytest.mark.processes

RUN_TIMEOUT = 60.0


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_the_effects_example_publishes_once_spawns_children_that_run_and_runs_its_hook_once(tmp_path):
    root = tmp_path / "effects"
    shutil.copytree(REPO / "examples" / "effects", root, ignore=shutil.ignore_patterns(".apiary", "out"))
    config = root / "apiary.yaml"
    db = Database(root / ".apiary" / "apiary.db")
    out = root / "out"

    first = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert first.returncode == 0, first.stderr
    jobs = db.rows("SELECT id, key, state FROM queue_job ORDER BY id")
    assert {row["state"] for row in jobs} == {"succeeded"}, [tuple(r) for r in jobs]

    # The publish ran once, keyed, not as a retry; its success is recorded once, with its output.
    [published] = lines(out / "published.log")
    item, key, retry = published.split()
    assert (item, retry) == ("v1.0.md", "retry=0")
    [parent] = db.rows("SELECT i.id, i.job_id FROM workflows_workflowinstance i WHERE i.parent_id IS NULL AND i.workflow = 'release'")
    records = {
        r["key"]: (r["state"], json.loads(r["value"]))
        for r in db.rows("SELECT key, state, value FROM queue_jobrecord WHERE job_id = ?", parent["job_id"])
    }
    assert records["publish:publish"] == ("done", {"output": f"https://releases.example.invalid/{key}"})
    [report] = db.rows("SELECT 1 FROM workflows_steprun WHERE instance_id = ? AND step_id = 'report' AND status = 'succeeded'", parent["id"])
    workspaces = list((root / ".apiary" / "workspaces").glob("*/report.txt"))
    assert [p.read_text() for p in workspaces] == [f"plan: release Version 1.0\nhttps://releases.example.invalid/{key}\n"]

    # The spawn's two children became tasks with the parent's key, ran `chore`, and name their parent.
    children = db.rows(
        "SELECT t.item_key, i.workflow, j.state FROM workflows_workflowinstance i"
        " JOIN workflows_task t ON t.id = i.task_id JOIN queue_job j ON j.id = i.job_id"
        " WHERE i.parent_id = ? ORDER BY t.item_key",
        parent["id"],
    )
    expected = ["v1.0.md/release/split/announce", "v1.0.md/release/split/changelog"]
    assert [tuple(c) for c in children] == [(k, "chore", "succeeded") for k in expected]
    assert sorted(lines(out / "chores.log")) == expected

    # The success hook ran once, as its own job, with its outcome and effect key.
    [hook] = [row for row in jobs if row["key"].endswith(":hook:succeeded")]
    assert hook["state"] == "succeeded"
    [notified] = lines(out / "notified.log")
    item, word, outcome, hook_key = notified.split()
    assert (item, word, outcome) == ("v1.0.md", "released", "succeeded") and hook_key != key
    assert not any(row["key"].endswith(":hook:failed") for row in jobs)

    # Nothing changed, nothing runs again.
    again = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert again.returncode == 0, again.stderr
    assert [tuple(r) for r in db.rows("SELECT id, key, state FROM queue_job ORDER BY id")] == [tuple(r) for r in jobs]
    assert len(lines(out / "published.log")) == 1 and len(lines(out / "notified.log")) == 1
    assert len(lines(out / "chores.log")) == 2

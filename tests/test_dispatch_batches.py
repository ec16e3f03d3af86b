"""A source poll is dispatched in batches (services.items_dispatch, one transaction per
services.BATCH items). What a batch must keep of the item-by-item dispatch: a second
poll creates nothing; a bad item is logged and skipped while the rest of its batch is
dispatched, and leaves nothing of itself; a batch that dies midway leaves nothing of
itself (no task without its instance and job); a changed item refreshes its task in
place or starts a new generation as before; a batch writes the very job dispatch writes; each batch wakes the claimers once
per job class. Runs on SQLite and (scripts/test) PostgreSQL."""

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from jobqueue.models import Job, JobEvent
from jobqueue.services import jobs as queue_jobs
from tests.factories import make_task, snapshot
from workflows import services
from workflows.config import load
from workflows.controlplane import ControlPlane
from workflows.models import Task, WorkflowInstance

pytestmark = pytest.mark.django_db

CONFIG = """
project: batches
agents:
  - {id: sh, runner: shell, command: cat, workspace_affinity: true, requires_labels: [linux]}
workflows:
  - id: fix
    agent: sh
    priority: 2
    retry: {max_attempts: 3, backoff: 5s}
    steps: [{id: work, run: "true"}]
    hooks: {on_failure: [{run: "./tell.sh"}]}
  - {id: plain, agent: sh, steps: [{id: work, run: "true"}]}
sources:
  - {id: inbox, type: directory, path: inbox, pattern: "*.md", workflows: %s, redispatch_on_change: %s}
  - {id: feed, type: command, command: "cat items.json", workflows: [plain]}
"""


def control_plane(tmp_path: Path, *, workflows=("fix",), redispatch=False, clock=None) -> ControlPlane:
    (tmp_path / "inbox").mkdir(exist_ok=True)
    (tmp_path / "apiary.yaml").write_text(CONFIG % (json.dumps(list(workflows)), json.dumps(redispatch)))
    return ControlPlane(config=load(tmp_path / "apiary.yaml", environ={}), clock=clock)


def write_items(tmp_path: Path, n: int, *, text: str = "# Item {i}\n\nbody {i}\n") -> None:
    for i in range(n):
        (tmp_path / "inbox" / f"item-{i:02d}.md").write_text(text.format(i=i))


@pytest.fixture
def small_batches(monkeypatch):
    """Three items a batch, so a handful of items spans several."""
    monkeypatch.setattr(services, "BATCH", 3)


def every_task_has_its_instances_and_jobs(workflows=("fix",)) -> bool:
    for task in Task.objects.all():
        instances = WorkflowInstance.objects.filter(task=task, generation=task.generation)
        if sorted(i.workflow for i in instances) != sorted(workflows) or any(i.job_id is None for i in instances):
            return False
    return Job.objects.count() == WorkflowInstance.objects.count()


def test_a_second_poll_of_the_same_items_creates_nothing(tmp_path, clock, small_batches):
    control = control_plane(tmp_path)
    write_items(tmp_path, 7)
    assert control.poll("inbox") == 7
    assert every_task_has_its_instances_and_jobs()
    before = snapshot()
    clock.advance(60)
    assert control.poll("inbox") == 0
    assert snapshot() == before


def test_a_batch_with_a_bad_item_dispatches_the_others_and_reports_it(tmp_path, clock, small_batches, caplog):
    control = control_plane(tmp_path)
    # A body the task takes but its job's payload cannot (JOB_PAYLOAD_CAP): dispatch refuses that item.
    items = [{"id": "a"}, {"id": "b"}, {"id": "c", "body": "x" * 700_000, "blob": "y" * 400_000}, {"id": "d"}]
    (tmp_path / "items.json").write_text(json.dumps(items))
    with caplog.at_level(logging.INFO, logger="apiary.controlplane"):
        assert control.poll("feed") == 3
    assert sorted(Task.objects.values_list("item_key", flat=True)) == ["a", "b", "d"]  # nothing of "c"
    assert every_task_has_its_instances_and_jobs(("plain",))
    assert "skipping item 'c'" in caplog.text and "JOB_PAYLOAD_CAP" in caplog.text
    assert "a batch of 3 items failed" in caplog.text  # [a, b, c] went item by item, then [d]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apiary.controlplane"):
        assert control.poll("feed") == 0  # the others stay dispatched once; the bad one is reported again
    assert "skipping item 'c'" in caplog.text and Job.objects.count() == 3


def test_a_batch_that_fails_midway_leaves_nothing_of_itself(tmp_path, clock, small_batches, monkeypatch):
    control = control_plane(tmp_path)
    write_items(tmp_path, 5)
    real = services.queue.jobs_enqueue_in
    calls = []

    def dies_in_the_second_batch(specs, **kw):
        calls.append(len(specs))
        if len(calls) == 2:  # its tasks and instances are written, its jobs not yet
            raise KeyboardInterrupt("the poll is stopped")
        return real(specs, **kw)

    monkeypatch.setattr(services.queue, "jobs_enqueue_in", dies_in_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        control.poll("inbox")
    assert Task.objects.count() == 3  # the first batch, whole
    assert every_task_has_its_instances_and_jobs()
    monkeypatch.undo()
    assert control.poll("inbox") == 2
    assert Task.objects.count() == 5 and every_task_has_its_instances_and_jobs()


@pytest.mark.parametrize("redispatch", [False, True], ids=["refreshed-in-place", "new-generation"])
def test_a_changed_item_is_synced_as_task_sync_syncs_it(tmp_path, clock, small_batches, redispatch):
    control = control_plane(tmp_path, redispatch=redispatch)
    write_items(tmp_path, 4)
    assert control.poll("inbox") == 4
    (tmp_path / "inbox" / "item-02.md").write_text("# Edited\n")
    clock.advance(60)
    assert control.poll("inbox") == (1 if redispatch else 0)
    task = Task.objects.get(item_key="item-02.md")
    assert (task.title, task.body, task.generation) == ("Edited", "# Edited\n", 2 if redispatch else 1)
    assert task.updated_at == clock.now() and task.created_at < clock.now()
    assert Task.objects.filter(generation=1).count() == (3 if redispatch else 4)
    assert every_task_has_its_instances_and_jobs()
    assert control.poll("inbox") == 0


def test_a_workflow_added_to_the_source_is_dispatched_for_the_tasks_it_already_has(tmp_path, clock, small_batches):
    assert control_plane(tmp_path, workflows=("fix",)).poll("inbox") == 0
    write_items(tmp_path, 4)
    assert control_plane(tmp_path, workflows=("fix",)).poll("inbox") == 4
    assert control_plane(tmp_path, workflows=("fix", "plain")).poll("inbox") == 4
    assert every_task_has_its_instances_and_jobs(("fix", "plain"))


# What differs between the jobs of two tasks by identity only (ids, keys, paths, what derives from them).
IDENTITY = frozenset({"id", "key", "instance_id", "item_key", "path", "effect_key", "affinity_key"})


def without_identity(value):
    if isinstance(value, dict):
        return {k: "*" if k in IDENTITY else without_identity(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_identity(v) for v in value]
    return value


def test_a_batch_writes_the_job_that_dispatch_writes(tmp_path, clock):
    control = control_plane(tmp_path)
    source = control.config.sources["inbox"]
    write_items(tmp_path, 2, text="# Same\n\nsame body\n")
    first, second = control._read("inbox")
    (batched,) = services.items_dispatch(config=control.config, source=source, items=[first])
    task = make_task(source="inbox", item_key=second.key, title=second.title, body=second.body, payload=second.payload)
    (single,) = services.dispatch(config=control.config, task=task, workflows=("fix",))

    def stored(job: Job) -> dict:
        job = Job.objects.get(pk=job.pk)
        return without_identity({f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields})

    assert stored(batched) == stored(single)
    assert stored(batched)["follow_ups"]["failed"][0]["payload"]["hook"]["outcome"] == "failed"
    task_id = batched.payload["task"]["id"]
    assert (batched.key, batched.affinity_key) == (f"{task_id}:1:fix", f"task:{task_id}")
    assert WorkflowInstance.objects.get(job=batched).pk == batched.payload["instance_id"]


def test_each_batch_wakes_the_claimers_once_per_job_class(tmp_path, clock, small_batches, monkeypatch):
    control = control_plane(tmp_path, workflows=("fix", "plain"))
    write_items(tmp_path, 5)
    wakes = []
    real_emit = queue_jobs.emit
    monkeypatch.setattr(queue_jobs, "emit", lambda cursor, wake: (wakes.append(wake), real_emit(cursor, wake)))
    assert control.poll("inbox") == 10
    # Batches of 3 and 2 items, 2 workflows each, one job class: a wake for 6 jobs, then one for 4.
    assert [wake.count for wake in wakes] == [6, 4]
    assert JobEvent.objects.filter(kind="enqueued").count() == 10


def test_a_batch_reads_and_writes_a_statement_per_kind_whatever_its_size(tmp_path, clock, django_assert_num_queries):
    control = control_plane(tmp_path)
    source = control.config.sources["inbox"]
    write_items(tmp_path, 40)
    items = control._read("inbox")
    services.items_dispatch(config=control.config, source=source, items=items[:2])  # the job class exists from here on
    # the look for anything new (a task it lacks); then in the transaction (its SAVEPOINT and RELEASE
    # inside the test's own) tasks read, inserted; instances read, inserted; jobs inserted, their events
    # (PostgreSQL: by the same statement), their pins (workspace affinity), the wake; the links
    queries = 11 if connection.vendor == "postgresql" else 12
    with django_assert_num_queries(queries):
        assert len(services.items_dispatch(config=control.config, source=source, items=items[2:5])) == 3
    with django_assert_num_queries(queries):
        assert len(services.items_dispatch(config=control.config, source=source, items=items[5:40])) == 35
    with django_assert_num_queries(2):  # nothing new: two plain reads, no transaction (on SQLite, no write lock)
        assert services.items_dispatch(config=control.config, source=source, items=items) == []


ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "tasks": "SELECT id, generation FROM workflows_task",
    "instances": "SELECT task_id, generation, workflow, job_id FROM workflows_workflowinstance",
    "jobs": "SELECT id FROM queue_job",
}


def rows_of(database: dict[str, str]) -> dict[str, list[tuple]]:
    """What the child left, read straight from its database."""
    if "DATABASE_URL" in database:
        import psycopg

        connect = psycopg.connect(database["DATABASE_URL"])
    else:
        connect = sqlite3.connect(database["APIARY_DB_PATH"])
    try:
        return {name: connect.execute(statement).fetchall() for name, statement in ROWS.items()}
    finally:
        connect.close()


def whole(rows: dict[str, list[tuple]]) -> bool:
    """Every task has its instance, every instance its job, and no job is anyone else's."""
    instances = {(task_id, generation): job_id for task_id, generation, _, job_id in rows["instances"]}
    return (
        all(instances.get(task) is not None for task in rows["tasks"])
        and len(instances) == len(rows["tasks"])
        and sorted(instances.values()) == sorted(job_id for (job_id,) in rows["jobs"])
    )


@pytest.mark.processes
def test_a_poll_killed_mid_batch_leaves_no_task_without_its_instance_and_job(tmp_path, live_database_url):
    control_plane(tmp_path)  # writes the config and the folder
    write_items(tmp_path, 7)
    if live_database_url:
        database, migrate = {"DATABASE_URL": live_database_url}, []  # pytest-django's test database, migrated
    else:
        database, migrate = {"APIARY_DB_PATH": str(tmp_path / "apiary.db")}, ["--migrate"]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "APIARY_DB_PATH")} | database
    env |= {"APIARY_STATE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}

    def poll(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "tests.poll_child", str(tmp_path / "apiary.yaml"), "--batch", "3", *args]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    killed = poll("--kill-in-batch", "2", *migrate)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = rows_of(database)
    assert len(left["tasks"]) == 3 and whole(left)  # the first batch whole, nothing of the second
    again = poll()
    assert (again.returncode, again.stdout.strip()) == (0, "4"), again.stderr[-3000:]
    left = rows_of(database)
    assert len(left["tasks"]) == 7 and whole(left)

"""Spawn on the control plane (issue 10): a done `spawn:<step>` record of a
job's journal, written by its current attempt as the worker does, becomes one
task per child, of the spawning task's source, dispatched to the child's
workflows (by default its source's), each instance naming its parent
instance; once, whatever is materialised again or restarted."""

import logging

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from apiary_site.management.commands.status import render_status
from jobqueue import services as queue
from jobqueue.exceptions import StaleAttempt
from jobqueue.models import Job, JobState
from jobqueue.selectors import status_document
from tests.factories import claim, make_task, register
from workflows import spawning
from workflows.config import load
from workflows.controlplane import ControlPlane
from workflows.models import Spawn, Task, WorkflowInstance
from workflows.services import dispatch

pytestmark = pytest.mark.django_db

CONFIG = """
project: spawns
agents: [{id: engineer, runner: shell, command: cat}]
workflows:
  - id: split
    agent: engineer
    steps:
      - {id: split, spawn: true, run: ./split.sh}
      - {id: more, spawn: true, run: ./more.sh}
  - id: review
    agent: engineer
    steps: [{id: look, run: "true"}]
sources:
  - {id: inbox, type: directory, path: inbox, workflows: [split, review]}
"""


@pytest.fixture
def config(tmp_path):
    (tmp_path / "inbox").mkdir()
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    return load(tmp_path / "apiary.yaml", environ={})


@pytest.fixture
def control(config, clock):
    return ControlPlane(config=config, clock=clock)


@pytest.fixture
def parent(config, clock):
    """The `split` instance of an inbox task, its job claimed: (instance, claim)."""
    task = make_task(source="inbox", item_key="big.md", title="Big")
    dispatch(config=config, task=task, workflows=("split",))
    [c] = claim(register("w1", capacity=4))
    return WorkflowInstance.objects.get(job_id=c.job_id), c


def spawn(c, children: list[dict], *, step: str = "split", state: str = "done"):
    """What the worker records for a spawn step, through its attempt's token."""
    return queue.job_record(
        attempt_id=c.attempt_id, token=c.token, key=f"spawn:{step}", state=state, value={"children": children}
    )


def children_of(instance: WorkflowInstance) -> dict[str, list[str]]:
    """{child task key: [its workflows]} of every instance spawned by `instance`."""
    found: dict[str, list[str]] = {}
    for child in WorkflowInstance.objects.filter(parent=instance).select_related("task").order_by("task_id", "workflow"):
        found.setdefault(child.task.item_key, []).append(child.workflow)
    return found


def spawned_tasks() -> list[Task]:
    return list(Task.objects.exclude(item_key="big.md").order_by("item_key"))


def test_a_done_spawn_record_makes_its_children_tasks_dispatched_to_the_parent_sources_workflows(control, parent):
    instance, c = parent
    spawn(c, [
        {"id": "a", "title": "Part A", "body": "do a", "payload": {"n": 1}},
        {"id": "b", "title": "Part B", "workflows": ["review"]},
    ])  # fmt: skip

    assert control.materialise() == 1

    a, b = spawned_tasks()
    assert (a.source, a.item_key, a.title, a.body, a.payload, a.generation) == (
        "inbox", "big.md/split/split/a", "Part A", "do a", {"n": 1}, 1,
    )  # fmt: skip
    assert (b.source, b.item_key, b.title, b.body, b.payload) == ("inbox", "big.md/split/split/b", "Part B", "", {})
    # a: the parent source's workflows (split, review); b: the ones it names.
    assert children_of(instance) == {a.item_key: ["review", "split"], b.item_key: ["review"]}
    jobs = Job.objects.filter(payload__task__id__in=[a.pk, b.pk])
    assert jobs.count() == 3 and {j.state for j in jobs} == {JobState.QUEUED}
    assert {j.payload["parent_instance_id"] for j in jobs} == {instance.pk}
    [marker] = Spawn.objects.all()
    assert (marker.job_id, marker.key, marker.instance, marker.children) == (c.job_id, "spawn:split", instance, 2)


def test_materialising_again_or_after_a_control_plane_restart_creates_no_duplicate(config, clock, control, parent):
    instance, c = parent
    spawn(c, [{"id": "a", "title": "A"}, {"id": "b", "title": "B"}])
    assert control.materialise() == 1
    before = (Task.objects.count(), WorkflowInstance.objects.count(), Job.objects.count())

    assert control.materialise() == 0
    assert ControlPlane(config=config, clock=clock).materialise() == 0  # a restarted control plane
    assert spawning.spawn_materialise(config=config, job_id=c.job_id, key="spawn:split") is None
    # The worker re-running the step after a crash: the done record is final, the spawn stays one.
    assert spawn(c, [{"id": "a", "title": "A"}, {"id": "c", "title": "C"}]).already_done
    assert control.materialise() == 0

    assert (Task.objects.count(), WorkflowInstance.objects.count(), Job.objects.count()) == before
    assert [t.item_key for t in spawned_tasks()] == ["big.md/split/split/a", "big.md/split/split/b"]
    assert Spawn.objects.count() == 1


def test_the_same_child_id_from_two_spawn_steps_makes_two_children(control, parent):
    instance, c = parent
    spawn(c, [{"id": "a", "title": "from split"}], step="split")
    spawn(c, [{"id": "a", "title": "from more"}], step="more")

    assert control.materialise() == 2

    assert [(t.item_key, t.title) for t in spawned_tasks()] == [
        ("big.md/split/more/a", "from more"), ("big.md/split/split/a", "from split"),
    ]  # fmt: skip
    assert set(children_of(instance)) == {"big.md/split/more/a", "big.md/split/split/a"}


def test_a_child_naming_an_unknown_workflow_is_skipped_with_a_warning_and_the_others_go(control, parent, caplog):
    instance, c = parent
    spawn(c, [
        {"id": "a", "title": "A", "workflows": ["nope", "review"]},
        {"id": "bad id!", "title": "not a child"},
        {"id": "b", "title": "B"},
    ])  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="apiary.spawn"):
        assert control.materialise() == 1

    assert children_of(instance) == {"big.md/split/split/a": ["review"], "big.md/split/split/b": ["review", "split"]}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'nope'" in w and "no such workflow" in w for w in warnings), warnings
    assert any("'bad id!'" in w for w in warnings), warnings
    assert Spawn.objects.get().children == 2


def test_a_started_spawn_record_makes_nothing(control, parent):
    _, c = parent
    spawn(c, [{"id": "a", "title": "A"}], state="started")

    assert not spawning.spawns_pending()
    assert control.materialise() == 0
    assert spawned_tasks() == [] and Spawn.objects.count() == 0


def test_a_stale_attempts_spawn_creates_nothing(control, parent, clock):
    _, c = parent
    clock.advance(3600)
    control.reap()  # the lease ran out: the attempt is no longer current
    with pytest.raises(StaleAttempt):
        spawn(c, [{"id": "a", "title": "A"}])

    assert control.materialise() == 0
    assert spawned_tasks() == []


def test_the_loop_materialises_and_is_not_idle_while_a_spawn_record_waits(control, parent):
    _, c = parent
    spawn(c, [{"id": "a", "title": "A", "workflows": ["review"]}])
    queue.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    control.polled = set(control.config.sources)
    assert not control.idle()  # no job queued or leased, but the children are still to come

    control.run_once()  # the loop materialises with its reaping

    [task] = spawned_tasks()
    assert task.instances.get().job.state == JobState.QUEUED
    assert not control.idle()


def test_status_shows_a_spawned_jobs_parent_instance(control, parent):
    instance, c = parent
    spawn(c, [{"id": "a", "title": "A", "workflows": ["review"]}])
    control.materialise()
    [child] = claim(register("w2"))
    child_instance = WorkflowInstance.objects.get(job_id=child.job_id)
    assert child_instance.parent == instance

    active = {a["job_id"]: a for a in status_document()["active"]}
    assert active[c.job_id]["parent_instance_id"] is None
    assert active[child.job_id]["parent_instance_id"] == instance.pk

    text = render_status(status_document())
    assert "PARENT" in text
    [row] = [line.split() for line in text.splitlines() if line.split()[:1] == [str(child.job_id)]]
    assert row[1:5] == [str(child_instance.pk), str(child_instance.task_id), "review", str(instance.pk)]


def test_the_admin_shows_a_childs_parent_and_a_parents_children(client, control, parent, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    instance, c = parent
    spawn(c, [{"id": "a", "title": "A", "workflows": ["review"]}])
    control.materialise()
    child = WorkflowInstance.objects.get(parent=instance)

    def page(*args) -> str:
        view = "change" if args else "changelist"
        response = client.get(reverse(f"admin:workflows_workflowinstance_{view}", args=args))
        assert response.status_code == 200
        return response.content.decode()

    assert str(instance) in page(child.pk)  # the child's parent
    parent_page = page(instance.pk)
    assert "spawned instances" in parent_page.lower() and "big.md/split/split/a" in parent_page
    changelist = page()
    assert "parent" in changelist.lower() and str(instance) in changelist


def test_a_database_failure_while_storing_a_child_leaves_the_whole_record_for_the_next_call(
    control, parent, monkeypatch
):
    """Only a child's own bad data skips it; a locked or lost database is not the child's fault,
    so nothing of the record is marked done and the next call creates every child."""
    from django.db import OperationalError

    instance, c = parent
    spawn(c, [{"id": "a", "title": "A"}, {"id": "b", "title": "B"}])
    real = spawning._task_of
    calls = []

    def locked_on_b(*, key, **kwargs):
        calls.append(key)
        if key.endswith("/b") and len(calls) == 2:
            raise OperationalError("database is locked")
        return real(key=key, **kwargs)

    monkeypatch.setattr(spawning, "_task_of", locked_on_b)
    assert control.materialise() == 0
    assert spawned_tasks() == [] and not Spawn.objects.exists()
    assert control.materialise() == 1
    assert [t.item_key for t in spawned_tasks()] == ["big.md/split/split/a", "big.md/split/split/b"]


def test_a_spawn_record_of_a_step_the_workflow_does_not_declare_spawn_makes_nothing(control, parent, caplog):
    """A worker's record is taken as a spawn step's output only where this control plane's
    apiary.yaml has that spawn step: a worker cannot make tasks for a workflow that spawns nothing."""
    instance, c = parent
    spawn(c, [{"id": "a", "title": "A"}], step="invented")
    with caplog.at_level(logging.WARNING, logger="apiary"):
        assert control.materialise() == 1
    assert spawned_tasks() == []
    assert Spawn.objects.get().children == 0
    assert "has no spawn step 'invented'" in caplog.text

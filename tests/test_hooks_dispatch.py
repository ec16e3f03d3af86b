"""Hooks at dispatch (issue 10): a workflow's `hooks` become follow-ups of its
instance's job, so the queue enqueues the hook job of the outcome the job
reaches — in the transaction that settles it, once, under the agent's routing
and the workflow's retry policy — with a payload `workflows.payload.read`
tells apart from a workflow job's. Running hooks is the executor's part."""

import dataclasses

import pytest

from jobqueue import services as queue
from jobqueue.models import Job, JobState
from jobqueue.types import Claim
from tests.factories import claim, make_task, register
from workflows import payload
from workflows.config import load
from workflows.models import Task, WorkflowInstance
from workflows.services import dispatch, enqueue_key, hook_key, instance_dispatch

pytestmark = pytest.mark.django_db

CONFIG = """
project: hooks
agents:
  - id: engineer
    runner: shell
    command: cat
    worker_pool: build
    requires_labels: [linux]
    requires_capabilities: [docker]
    workspace_affinity: true
workflows:
  - id: fix
    agent: engineer
    priority: 3
    retry: {max_attempts: 2, backoff: 5s, backoff_max: 1m}
    steps: [{id: work, run: "true"}]
    hooks:
      on_success: [{run: "./notify.sh done"}, {id: tell, run: "./tell.sh", timeout: 30s}]
      on_failure: [{run: "./notify.sh failed"}]
  - id: plain
    agent: engineer
    steps: [{id: work, run: "true"}]
"""


@pytest.fixture
def config(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    return load(tmp_path / "apiary.yaml", environ={})


def new_task() -> Task:
    return make_task(source="inbox", title="Fix it", body="b")


def worker(worker_id: str = "w1"):
    return register(worker_id, pool="build", labels=["linux"], capabilities=["docker"])


def finish(c, outcome: str) -> None:
    queue.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome=outcome)


def hook_jobs() -> list[Job]:
    return list(Job.objects.filter(key__contains=":hook:").order_by("pk"))


def test_dispatching_a_workflow_with_hooks_stores_one_follow_up_per_outcome_with_hooks(config, clock):
    task = new_task()
    [job] = dispatch(config=config, task=task, workflows=("fix",))
    assert set(job.follow_ups) == {"succeeded", "failed"}  # no on_cancel: nothing for a cancel
    [spec] = job.follow_ups["succeeded"]
    assert spec["key"] == hook_key(job.key, "succeeded") == f"{task.pk}:1:fix:hook:succeeded"
    assert spec["retry"] == {"max_attempts": 2, "backoff": 5.0, "backoff_max": 60.0}
    assert hook_jobs() == []  # nothing runs before the outcome


def test_a_success_enqueues_exactly_the_success_hook_job_with_the_instance_jobs_routing(config, clock):
    task = new_task()
    [job] = dispatch(config=config, task=task, workflows=("fix",))
    w = worker()
    [c] = claim(w)
    finish(c, "succeeded")

    [hook] = hook_jobs()
    assert hook.key == f"{enqueue_key(task, 'fix')}:hook:succeeded"
    assert hook.state == JobState.QUEUED
    # The same routing; its requirement set differs by apiary.hooks alone (asserted below).
    same = ("project", "source", "agent", "runner", "pool", "affinity_key", "priority", "max_attempts")
    assert {f: getattr(hook, f) for f in same} == {f: getattr(job, f) for f in same}
    assert (hook.project, hook.agent, hook.runner, hook.pool, hook.affinity_key) == (
        "hooks", "engineer", "shell", "build", f"task:{task.pk}",
    )  # fmt: skip
    assert (hook.priority, hook.retry_max_attempts, hook.retry_backoff, hook.retry_backoff_max) == (3, 2, 5.0, 60.0)
    # An old worker (no apiary.hooks) would run a hook job as its workflow: it may not claim one.
    assert sorted(hook.requirements.capabilities) == ["apiary.hooks", "apiary.workflow", "docker", "runner:shell"]
    assert hook.requirements.labels == ["linux"]
    assert hook.follow_ups == {}  # a hook has no hooks

    # The hook job is claimable by the worker that ran the instance (its affinity pin), and reads back.
    [hc] = claim(w)
    assert hc.job_id == hook.pk
    read = payload.read(hc)
    instance = WorkflowInstance.objects.get(job=job)
    assert read == payload.HookJob(
        workflow="fix",
        instance_id=instance.pk,
        task=job.payload["task"],
        outcome="succeeded",
        effect_key=payload.effect_key_of(project="hooks", key=hook.key),
    )
    assert config.workflows["fix"].hooks[read.outcome][1].id == "tell"  # the steps, by reference


def test_a_failure_enqueues_the_failure_hook_only_once_the_retries_are_spent(config, clock):
    task = new_task()
    dispatch(config=config, task=task, workflows=("fix",))
    w = worker()
    [first] = claim(w)
    finish(first, "failed")
    assert hook_jobs() == []  # requeued for its retry: not an outcome yet
    clock.advance(120)
    [second] = claim(w)
    finish(second, "failed")
    [hook] = hook_jobs()
    assert hook.key == f"{task.pk}:1:fix:hook:failed"
    assert hook.payload["hook"]["outcome"] == "failed"


def test_a_cancel_without_an_on_cancel_hook_enqueues_nothing(config, clock):
    [job] = dispatch(config=config, task=new_task(), workflows=("fix",))
    queue.job_cancel(job_id=job.pk)
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    assert hook_jobs() == []


def test_a_cancel_enqueues_the_on_cancel_hook(config, clock):
    fix = config.workflows["fix"]
    hooks = {**fix.hooks, "cancelled": fix.hooks["failed"]}
    config.workflows["fix"] = dataclasses.replace(fix, hooks=hooks)  # the dict is the test's copy
    task = new_task()
    [job] = dispatch(config=config, task=task, workflows=("fix",))
    queue.job_cancel(job_id=job.pk)
    [hook] = hook_jobs()
    assert hook.key == f"{task.pk}:1:fix:hook:cancelled"


def test_a_workflow_without_hooks_enqueues_no_follow_up(config, clock):
    [job] = dispatch(config=config, task=new_task(), workflows=("plain",))
    assert job.follow_ups == {}
    [c] = claim(worker())
    finish(c, "succeeded")
    assert Job.objects.count() == 1


def test_dispatching_the_same_task_twice_creates_one_job_and_one_hook_job(config, clock):
    task = new_task()
    [job] = dispatch(config=config, task=task, workflows=("fix", "plain"))[:1]
    assert dispatch(config=config, task=task, workflows=("fix", "plain")) == []
    _, again, created = instance_dispatch(config=config, task=task, workflow=config.workflows["fix"])
    assert (again.pk, created) == (job.pk, False)
    assert Job.objects.filter(key=job.key).count() == 1
    [c] = claim(worker())
    assert c.job_id == job.pk
    finish(c, "succeeded")
    finish(c, "succeeded")  # the same finish again
    assert [h.key for h in hook_jobs()] == [hook_key(job.key, "succeeded")]


def test_the_effect_key_is_stable_per_hook_job_and_differs_by_outcome_and_project(config, clock):
    [job] = dispatch(config=config, task=new_task(), workflows=("fix",))
    keys = {outcome: specs[0]["payload"]["hook"]["effect_key"] for outcome, specs in job.follow_ups.items()}
    assert keys["succeeded"] == payload.effect_key_of(project="hooks", key=hook_key(job.key, "succeeded"))
    assert keys["succeeded"] != keys["failed"]
    assert payload.effect_key_of(project="other", key=hook_key(job.key, "succeeded")) != keys["succeeded"]


# --------------------------------------------------------------------------- payload.read


def _claim_of(p: dict):
    return Claim(
        job_id=7, attempt_id=1, attempt_number=1, token="t", lease_expires_at=None, agent="a", runner="shell", payload=p
    )


class _Task:
    pk, source, item_key, generation, title, body, payload = 4, "inbox", "a.md", 1, "t", "b", {}


def test_a_workflow_job_still_reads_as_a_workflow_job():
    p = payload.payload_of(workflow="fix", instance_id=3, task=_Task())
    assert payload.read(_claim_of(p)) == payload.WorkflowJob(workflow="fix", instance_id=3, task=p["task"])


def test_a_hook_payload_round_trips():
    p = payload.hook_payload_of(workflow="fix", instance_id=3, task=_Task(), outcome="cancelled", effect_key="ab12")
    assert payload.read(_claim_of(p)) == payload.HookJob(
        workflow="fix", instance_id=3, task=p["task"], outcome="cancelled", effect_key="ab12"
    )


@pytest.mark.parametrize(
    "hook",
    [None, "succeeded", {}, {"outcome": "finished", "effect_key": "k"}, {"outcome": "failed"},
     {"outcome": "failed", "effect_key": "has space"}, {"outcome": "failed", "effect_key": "k" * 129},
     {"outcome": ["failed"], "effect_key": "k"}],
)  # fmt: skip
def test_a_damaged_hook_payload_is_refused(hook):
    p = {**payload.payload_of(workflow="fix", instance_id=3, task=_Task()), "hook": hook}
    with pytest.raises(payload.PayloadError, match="job 7: its payload's hook"):
        payload.read(_claim_of(p))


def test_a_hook_outcome_that_is_not_terminal_is_not_written():
    with pytest.raises(ValueError, match="a hook outcome is one of succeeded, failed, cancelled"):
        payload.hook_payload_of(workflow="fix", instance_id=3, task=_Task(), outcome="queued", effect_key="k")


def test_status_tells_a_running_hook_job_from_its_instances_workflow_job(config, clock):
    from apiary_site.management.commands.status import render_status
    from jobqueue.selectors import status_document

    [job] = dispatch(config=config, task=new_task(), workflows=("fix",))
    w = worker()
    [c] = claim(w)
    assert [a["hook"] for a in status_document()["active"]] == [None]
    finish(c, "succeeded")
    [hc] = claim(w)

    [active] = status_document()["active"]
    assert (active["job_id"], active["instance_id"], active["hook"]) == (hc.job_id, job.payload["instance_id"], "succeeded")
    [row] = [line for line in render_status(status_document()).splitlines() if line.split()[:1] == [str(hc.job_id)]]
    assert "fix (hook succeeded)" in row


def test_the_instance_admin_shows_its_hook_job_failed_while_the_instance_succeeded(config, clock, client, settings):
    from django.contrib.auth.models import User
    from django.urls import reverse

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    [job] = dispatch(config=config, task=new_task(), workflows=("fix",))
    w = worker()
    [c] = claim(w)
    finish(c, "succeeded")
    for _ in range(2):  # the workflow's retry: max_attempts 2
        clock.advance(600)
        [hc] = claim(w)
        finish(hc, "failed")
    [hook] = hook_jobs()
    assert hook.state == JobState.FAILED and Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED

    page = client.get(reverse("admin:workflows_workflowinstance_change", args=[job.payload["instance_id"]]))
    text = page.content.decode()
    assert page.status_code == 200
    assert f"job {hook.pk}</a>: on succeeded hook, failed" in text

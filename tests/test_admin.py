"""Django admin: read-only queue rows, computed worker health, actions that call services."""

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobqueue import services
from jobqueue.models import Affinity, Attempt, Job, JobEvent, JobState, RequirementSet, Worker
from tests.factories import claim, enqueue, instance_id, make_task
from workflows.models import Task, TaskState, WorkflowInstance
from workflows.selectors import task_state
from workflows.services import affinity_key

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    # admin_client creates a superuser per test; the default hasher costs ~0.5 s each.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


QUEUE_MODELS = (Job, Affinity, JobEvent, RequirementSet, Worker, Task, WorkflowInstance)


def url(model, view: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


def act(client, model, action: str, ids) -> str:
    """Run an admin action on the changelist; returns the messages shown, one per line."""
    response = client.post(
        url(model, "changelist"),
        {"action": action, "_selected_action": [str(i) for i in ids], "index": "0"},
        follow=True,
    )
    assert response.status_code == 200
    return "\n".join(str(m) for m in response.context["messages"])


def test_job_admin_is_under_the_queue_label():
    assert Job._meta.app_label == "queue"
    assert reverse("admin:queue_job_changelist") == "/admin/queue/job/"


@pytest.mark.parametrize("model", QUEUE_MODELS, ids=lambda m: m.__name__)
def test_changelists_and_detail_pages_render(admin_client, busy_queue, model):
    response = admin_client.get(url(model, "changelist"))
    assert response.status_code == 200
    obj = model.objects.first()
    assert obj is not None
    assert admin_client.get(url(model, "change", obj.pk)).status_code == 200


def test_job_changelist_columns_filters_and_search(admin_client, busy_queue):
    running, queued = busy_queue["running"], busy_queue["queued"]
    page = admin_client.get(url(Job, "changelist")).content.decode()
    for text in (running.key, "leased", "triage", "engineer", "shell", "build"):
        assert text in page
    for param in ("state__exact", "pool", "agent", "runner"):
        assert f"?{param}=" in page  # a filter link for each
    filtered = admin_client.get(url(Job, "changelist"), {"state": "queued"}).context["cl"]
    assert [j.pk for j in filtered.result_list] == [queued.pk]
    found = admin_client.get(url(Job, "changelist"), {"q": running.key}).context["cl"]
    assert [j.pk for j in found.result_list] == [running.pk]


def test_job_page_shows_attempts_and_events_but_never_the_token_hash(admin_client, busy_queue):
    running = busy_queue["running"]
    attempt = Attempt.objects.get(job=running)
    page = admin_client.get(url(Job, "change", running.pk)).content.decode()
    assert "claimed" in page and "enqueued" in page  # events inline
    assert "lease expires at" in page.lower()  # attempts inline
    assert attempt.token_hash not in page
    assert "token_hash" not in page and "token hash" not in page.lower()


def test_instance_page_shows_step_history(admin_client, busy_queue):
    page = admin_client.get(url(WorkflowInstance, "change", instance_id(busy_queue["running"]))).content.decode()
    assert "plan" in page and "running" in page


@pytest.mark.parametrize("model", QUEUE_MODELS, ids=lambda m: m.__name__)
def test_no_add_change_or_delete(admin_client, busy_queue, rf, model):
    obj = model.objects.first()
    assert admin_client.get(url(model, "add")).status_code == 403
    assert admin_client.post(url(model, "add"), {}).status_code == 403
    assert admin_client.get(url(model, "delete", obj.pk)).status_code == 403
    assert admin_client.post(url(model, "delete", obj.pk), {"post": "yes"}).status_code == 403
    assert admin_client.post(url(model, "change", obj.pk), {}).status_code == 403
    assert model.objects.filter(pk=obj.pk).exists()
    model_admin = admin.site._registry[model]
    request = rf.get("/")
    request.user = User.objects.get(username="admin")
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request, obj)
    assert not model_admin.has_delete_permission(request, obj)
    assert model_admin.has_view_permission(request, obj)
    assert "delete_selected" not in model_admin.get_actions(request)


def test_job_edit_post_changes_nothing(admin_client, busy_queue):
    queued = busy_queue["queued"]
    admin_client.post(url(Job, "change", queued.pk), {"state": "succeeded", "priority": "99"})
    queued.refresh_from_db()
    assert queued.state == JobState.QUEUED and queued.priority == 0


def test_cancel_action(admin_client, busy_queue):
    running, queued = busy_queue["running"], busy_queue["queued"]
    response = act(admin_client, Job, "cancel_jobs", [running.pk, queued.pk])
    text = response
    assert f"cancelled: job {queued.pk}" in text
    assert f"cancel requested: job {running.pk}" in text
    queued.refresh_from_db()
    running.refresh_from_db()
    assert queued.state == JobState.CANCELLED
    assert running.state == JobState.LEASED and running.cancel_requested_at is not None
    c = busy_queue["claim"]
    assert services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token).cancel
    again = act(admin_client, Job, "cancel_jobs", [queued.pk])
    assert f"already finished: job {queued.pk}" in again


def test_instance_cancel_action(admin_client, busy_queue):
    queued = busy_queue["queued"]
    act(admin_client, WorkflowInstance, "cancel_instances", [instance_id(queued)])
    queued.refresh_from_db()
    assert queued.state == JobState.CANCELLED
    instance = WorkflowInstance.objects.select_related("job", "task").get(pk=instance_id(queued))
    assert instance.job_id == queued.pk and instance.job.state == JobState.CANCELLED
    assert task_state(instance.task) == TaskState.CANCELLED


def test_release_affinity_actions(admin_client, busy_queue):
    task, running = busy_queue["task"], busy_queue["running"]
    key = affinity_key(task.pk)
    assert running.affinity_key == key and Affinity.objects.filter(key=key).exists()
    text = act(admin_client, Job, "release_affinity", [running.pk])
    assert f"affinity released: {key}" in text
    assert not Affinity.objects.filter(key=key).exists()
    text = act(admin_client, Task, "release_affinity", [task.pk])
    assert f"not pinned: {key}" in text


def test_release_from_affinity_changelist(admin_client, busy_queue):
    task = busy_queue["task"]
    key = affinity_key(task.pk)
    act(admin_client, Affinity, "release", [Affinity.objects.get(key=key).pk])
    assert not Affinity.objects.filter(key=key).exists()


def test_worker_changelist_shows_computed_health_and_active_jobs(admin_client, busy_queue, clock, queue_config):
    queue_config(worker_timeout=30)
    cl = admin_client.get(url(Worker, "changelist")).context["cl"]
    [row] = cl.result_list
    assert row.live_attempts == 1
    page = admin_client.get(url(Worker, "changelist")).content.decode()
    assert "healthy" in page and "stale" not in page
    clock.advance(31)
    page = admin_client.get(url(Worker, "changelist")).content.decode()
    assert "stale" in page
    assert admin_client.get(url(Worker, "changelist")).context["cl"].result_list[0].live_attempts == 0  # lease passed
    assert busy_queue["worker"].session not in admin_client.get(url(Worker, "change", "w1")).content.decode()


def test_drain_and_undrain_actions(admin_client, busy_queue):
    worker = busy_queue["worker"]
    text = act(admin_client, Worker, "drain", ["w1"])
    assert "drain requested: w1" in text
    assert Worker.objects.get(pk="w1").drain_requested
    assert claim(worker) == []
    act(admin_client, Worker, "undrain", ["w1"])
    assert not Worker.objects.get(pk="w1").drain_requested


def test_actions_need_the_change_permission(client, busy_queue):
    """A staff user who may only view jobs sees them but cannot operate the queue."""
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    queued = busy_queue["queued"]
    assert client.get(url(Job, "changelist")).status_code == 200
    act(client, Job, "cancel_jobs", [queued.pk])
    queued.refresh_from_db()
    assert queued.state == JobState.QUEUED
    viewer.user_permissions.add(Permission.objects.get(codename="change_job"))
    viewer = User.objects.get(pk=viewer.pk)  # drop the permission cache
    client.force_login(viewer)
    act(client, Job, "cancel_jobs", [queued.pk])
    queued.refresh_from_db()
    assert queued.state == JobState.CANCELLED


def test_task_changelist_shows_and_filters_the_derived_state_in_a_fixed_number_of_queries(admin_client, clock):
    def changelist(**params):
        with CaptureQueriesContext(connection) as seen:
            response = admin_client.get(url(Task, "changelist"), params)
        return response.context["cl"], len(seen)

    services.job_cancel(job_id=enqueue(make_task()).pk)
    enqueue(make_task())
    _, few = changelist()
    for _ in range(20):
        enqueue(make_task())
    page, many = changelist()
    assert many == few  # the state is annotated, not read row by row
    assert sorted({t.state for t in page.result_list}) == ["active", "cancelled"]
    cancelled, _ = changelist(state="cancelled")
    assert [t.state for t in cancelled.result_list] == ["cancelled"]

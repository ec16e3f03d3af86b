"""Operating the queue from the admin: detail-page buttons (POST, CSRF, permission-checked,
one service call each) and list actions for cancel, retry, release, drain, undrain and forget;
each names the admin user as its actor in the row's events and is kept in LogEntry."""

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client

from jobqueue import services
from jobqueue.models import Affinity, Job, JobEvent, JobState, Worker, WorkerEvent
from tests.factories import claim, enqueue, instance_id, register
from tests.test_admin import act, url
from workflows.models import WorkflowInstance

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("admin_fast_passwords")]


def operate(client, model, pk, operation, **kwargs):
    return client.post(url(model, "operate", pk, operation), follow=True, **kwargs)


def messages_of(response) -> str:
    return "\n".join(str(m) for m in response.context["messages"])


def failed_job():
    job = enqueue()
    [c] = claim(register("w9"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", error="boom")
    return job


def logged(obj) -> list[str]:
    return [e.change_message for e in LogEntry.objects.filter(object_id=str(obj.pk)).order_by("id")]


def test_job_page_shows_the_buttons_its_state_allows(admin_client, busy_queue):
    running = admin_client.get(url(Job, "change", busy_queue["running"].pk)).content.decode()
    assert f'action="/admin/queue/job/{busy_queue["running"].pk}/operate/cancel/"' in running
    assert "/operate/release/" in running  # pinned
    assert "/operate/retry/" not in running
    failed = failed_job()
    page = admin_client.get(url(Job, "change", failed.pk)).content.decode()
    assert "/operate/retry/" in page and "/operate/cancel/" not in page
    assert 'name="csrfmiddlewaretoken"' in page


def test_cancel_button_cancels_and_records_the_actor_and_a_log_entry(admin_client, busy_queue):
    queued = busy_queue["queued"]
    response = operate(admin_client, Job, queued.pk, "cancel")
    assert f"job {queued.pk} cancelled" in messages_of(response)
    assert Job.objects.get(pk=queued.pk).state == JobState.CANCELLED
    assert JobEvent.objects.get(job=queued, kind="cancelled").detail["actor"] == "admin"
    assert logged(queued) == [f"job {queued.pk} cancelled"]


def test_retry_button_requeues_a_failed_job(admin_client, clock):
    job = failed_job()
    response = operate(admin_client, Job, job.pk, "retry")
    assert f"job {job.pk} was failed; queued again as attempt 2" in messages_of(response)
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    assert JobEvent.objects.get(job=job, kind="retried").detail["actor"] == "admin"
    assert logged(job) == [f"job {job.pk} was failed; queued again as attempt 2"]


def test_a_button_that_does_not_apply_now_changes_nothing_and_says_so(admin_client, clock):
    """A stale page's Retry on a job that succeeded meanwhile: no service call, no log entry."""
    job = enqueue()
    [c] = claim(register("w1"))
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    response = operate(admin_client, Job, job.pk, "retry")
    assert "Retry does not apply to" in messages_of(response)
    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
    assert logged(job) == []


def test_release_button_unpins(admin_client, busy_queue):
    running = busy_queue["running"]
    operate(admin_client, Job, running.pk, "release")
    assert not Affinity.objects.exists()
    assert WorkerEvent.objects.get(kind="affinity_released").detail["actor"] == "admin"


def test_buttons_refuse_a_get(admin_client, busy_queue):
    response = admin_client.get(url(Job, "operate", busy_queue["queued"].pk, "cancel"))
    assert response.status_code == 405
    assert Job.objects.get(pk=busy_queue["queued"].pk).state == JobState.QUEUED


def test_buttons_need_a_csrf_token(busy_queue):
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.create_superuser("root", password="pw"))
    response = client.post(url(Job, "operate", busy_queue["queued"].pk, "cancel"))
    assert response.status_code == 403
    assert Job.objects.get(pk=busy_queue["queued"].pk).state == JobState.QUEUED


def test_buttons_need_the_change_permission(client, busy_queue):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(viewer)
    page = client.get(url(Job, "change", busy_queue["queued"].pk)).content.decode()
    assert "/operate/" not in page
    assert client.post(url(Job, "operate", busy_queue["queued"].pk, "cancel")).status_code == 403
    assert Job.objects.get(pk=busy_queue["queued"].pk).state == JobState.QUEUED


def test_an_unknown_operation_is_a_404(admin_client, busy_queue):
    assert admin_client.post(url(Job, "operate", busy_queue["queued"].pk, "explode")).status_code == 404


def test_retry_action_on_the_job_list(admin_client, clock):
    job = failed_job()
    text = act(admin_client, Job, "retry_jobs", [job.pk])
    assert f"job {job.pk} was failed; queued again" in text
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED


def test_instance_buttons_and_actions_cancel_and_retry(admin_client, clock):
    job = failed_job()
    iid = instance_id(job)
    page = admin_client.get(url(WorkflowInstance, "change", iid)).content.decode()
    assert "/operate/retry/" in page and "/operate/cancel/" not in page
    response = operate(admin_client, WorkflowInstance, iid, "retry")
    assert f"instance {iid}: job {job.pk} was failed; queued again" in messages_of(response)
    assert logged(WorkflowInstance.objects.get(pk=iid))
    text = act(admin_client, WorkflowInstance, "cancel_instances", [iid])
    assert f"cancelled: job {job.pk}" in text
    assert JobEvent.objects.get(job=job, kind="cancelled").detail["actor"] == "admin"
    text = act(admin_client, WorkflowInstance, "retry_instances", [iid])
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED


def test_cancel_action_is_logged_per_job(admin_client, busy_queue):
    queued = busy_queue["queued"]
    act(admin_client, Job, "cancel_jobs", [queued.pk])
    assert logged(queued) == [f"cancelled: job {queued.pk}"]


def test_worker_buttons_drain_undrain_and_forget(admin_client, busy_queue, clock):
    page = admin_client.get(url(Worker, "change", "w1")).content.decode()
    assert "/operate/drain/" in page and "/operate/forget/" not in page  # healthy and busy
    operate(admin_client, Worker, "w1", "drain")
    assert Worker.objects.get(pk="w1").drain_requested
    page = admin_client.get(url(Worker, "change", "w1")).content.decode()
    assert "/operate/undrain/" in page
    operate(admin_client, Worker, "w1", "undrain")
    assert not Worker.objects.get(pk="w1").drain_requested
    assert [(e.kind, e.detail["actor"]) for e in WorkerEvent.objects.filter(worker_id="w1")] == [
        ("drain_requested", "admin"), ("drain_withdrawn", "admin"),
    ]  # fmt: skip
    assert len(logged(Worker.objects.get(pk="w1"))) == 2


def test_forget_a_stale_worker_from_its_page_and_the_list(admin_client, clock):
    register("w1")
    register("w2")
    clock.advance(31)
    page = admin_client.get(url(Worker, "change", "w1")).content.decode()
    assert "/operate/forget/" in page
    operate(admin_client, Worker, "w1", "forget")
    assert Worker.objects.get(pk="w1").forgotten_at is not None
    text = act(admin_client, Worker, "forget", ["w2"])
    assert "forgotten: w2" in text
    assert WorkerEvent.objects.get(worker_id="w2", kind="forgotten").detail["actor"] == "admin"


def test_forgetting_a_healthy_worker_says_why_not(admin_client, clock):
    register("w1")
    text = act(admin_client, Worker, "forget", ["w1"])
    assert "only a stale or exited worker can be forgotten" in text
    assert Worker.objects.get(pk="w1").forgotten_at is None


def test_the_worker_page_lists_operator_actions_with_their_actor(admin_client, busy_queue):
    services.worker_drain(worker_id="w1", actor="cli:ops")
    page = admin_client.get(url(Worker, "change", "w1")).content.decode()
    assert "drain_requested cli:ops" in page


def test_release_actions_are_logged_on_the_rows_that_named_the_pin(admin_client, busy_queue):
    from workflows.models import Task

    task = busy_queue["task"]
    act(admin_client, Task, "release_affinity", [task.pk])
    assert logged(Task.objects.get(pk=task.pk)) == [f"affinity released: task:{task.pk}"]
    assert WorkerEvent.objects.get(kind="affinity_released").detail == {"key": f"task:{task.pk}", "actor": "admin"}

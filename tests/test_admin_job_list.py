"""The job, instance and worker pages answer an operator's questions: task title (searchable),
worker, elapsed, why a job waits (a real block told from backlog) or ended, an instance
`running` while leased, step runs readable, times to the second, Draining as `apiary status`
says it; and the job list costs the same few queries however many rows it shows."""

import pytest

from jobqueue import services
from jobqueue.models import Job, Worker
from jobqueue.selectors import status_document
from tests.factories import claim, enqueue, instance_id, make_task, register
from tests.test_admin import url
from workflows.models import StepRun, WorkflowInstance

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("admin_fast_passwords")]


def rows(admin_client, **params):
    return [j.pk for j in admin_client.get(url(Job, "changelist"), params).context["cl"].result_list]


def test_job_list_columns_title_worker_elapsed(admin_client, clock):
    running = enqueue(make_task(title="Fix the login page"))
    [c] = claim(register("w1"))
    clock.advance(75)
    page = admin_client.get(url(Job, "changelist")).content.decode()
    for header in ("task title", "instance", "worker", "elapsed", "why"):
        assert f">{header.capitalize()}<" in page or f">{header}<" in page.lower()
    assert "Fix the login page" in page
    assert '<td class="field-worker">w1</td>' in page
    assert "running 1m 15s" in page
    assert f'href="/admin/workflows/workflowinstance/{instance_id(running)}/change/"' in page
    assert c.job_id == running.pk


def test_job_search_finds_the_task_title(admin_client, clock):
    wanted = enqueue(make_task(title="Fix the login page"))
    enqueue(make_task(title="Write the release notes"))
    assert rows(admin_client, q="login") == [wanted.pk]


def test_why_tells_a_real_block_from_backlog_and_shows_the_last_error(admin_client, clock):
    register("w1", capacity=1)
    backlog = enqueue()
    blocked = enqueue(pool="gpu")
    failed = enqueue()
    w2 = register("w2")
    [c] = claim(w2)
    assert c.job_id == backlog.pk
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", error="exit 3: tests failed")
    page = admin_client.get(url(Job, "changelist")).content.decode()
    assert "blocked: no worker in pool gpu" in page
    assert "backlog" in page
    assert "exit 3: tests failed" in page
    assert rows(admin_client, waiting="blocked") == [blocked.pk]
    assert rows(admin_client, waiting="backlog") == [failed.pk]


def test_job_changelist_does_not_query_per_row(admin_client, clock, django_assert_max_num_queries):
    worker = register("w1", capacity=10)
    for i in range(40):
        enqueue(make_task(title=f"task {i}"), pool="gpu" if i % 3 == 0 else None)
    for c in claim(worker, max_jobs=10):
        if c.job_id % 2:
            services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", error="boom")
    admin_client.get(url(Job, "changelist"))  # warm the session
    with django_assert_max_num_queries(20):
        response = admin_client.get(url(Job, "changelist"))
    assert len(response.context["cl"].result_list) == 40


def test_instance_reads_running_while_leased(admin_client, busy_queue):
    running, queued = busy_queue["running"], busy_queue["queued"]
    page = admin_client.get(url(WorkflowInstance, "changelist")).content.decode()
    assert '<td class="field-state">running</td>' in page
    assert '<td class="field-state">queued</td>' in page
    detail = admin_client.get(url(WorkflowInstance, "change", instance_id(running))).content.decode()
    assert '<div class="readonly">running</div>' in detail
    services.job_cancel(job_id=running.pk)
    page = admin_client.get(url(WorkflowInstance, "changelist")).content.decode()
    assert "running (cancel requested)" in page
    assert queued.state == "queued"


def test_step_runs_are_a_table_with_preformatted_output(admin_client, busy_queue, clock):
    job = busy_queue["running"]
    StepRun.objects.create(
        instance_id=instance_id(job), attempt_number=1, step_id="test", status="failed", started_at=clock.now(),
        ended_at=clock.now(), exit_code=1, output_tail="line one\n  <indented> line two\n",
    )  # fmt: skip
    page = admin_client.get(url(WorkflowInstance, "change", instance_id(job))).content.decode()
    assert '<pre class="apiary-log">line one\n  &lt;indented&gt; line two\n</pre>' in page


def test_a_remote_workers_reported_steps_are_a_readable_table(admin_client, clock):
    """A remote worker's step history stays on its host; its finish's summary is what the control plane has."""
    job = enqueue()
    [c] = claim(register("w1"))
    summary = {"steps": [{"id": "build", "status": "failed", "exit_code": 2, "duration": 4.2,
                          "output_tail": "compiling\nerror: x\n"}], "worker_id": "w1", "attempt": 1}  # fmt: skip
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="failed", summary=summary)
    page = admin_client.get(url(WorkflowInstance, "change", instance_id(job))).content.decode()
    assert "<p>attempt 1 on w1</p>" in page
    assert "<td>build</td><td>failed</td><td>2</td><td>4s</td>" in page
    assert '<pre class="apiary-log">compiling\nerror: x\n</pre>' in page
    assert "\\n" not in page.split("attempt 1 on w1")[1].split("</table>")[0]  # no literal \n


def test_times_are_shown_to_the_second(admin_client, busy_queue, clock):
    page = admin_client.get(url(Job, "change", busy_queue["running"].pk)).content.decode()
    assert clock.now().strftime("%Y-%m-%d %H:%M:%S") in page


def test_worker_heartbeat_is_relative_too(admin_client, busy_queue, clock):
    clock.advance(7)
    page = admin_client.get(url(Worker, "changelist")).content.decode()
    assert "(7s ago)" in page


def test_draining_column_agrees_with_apiary_status_after_a_drain(admin_client, busy_queue):
    services.worker_drain(worker_id="w1")
    [doc] = status_document()["workers"]
    assert doc["draining"] is True
    page = admin_client.get(url(Worker, "changelist")).content.decode()
    cell = page.split('<td class="field-is_draining">')[1].split("</td>")[0]
    assert 'alt="True"' in cell


def test_an_exited_worker_shows_exited(admin_client, busy_queue, clock):
    worker = Worker.objects.get(pk="w1")
    services.worker_heartbeat(worker_id="w1", session=worker.session, draining=True, ready=False)
    clock.advance(3600)
    page = admin_client.get(url(Worker, "changelist")).content.decode()
    assert '<td class="field-health">exited</td>' in page


def test_forgotten_workers_are_hidden_unless_asked_for(admin_client, clock):
    register("w1")
    register("w2")
    clock.advance(31)
    services.worker_forget(worker_id="w1")
    shown = [w.pk for w in admin_client.get(url(Worker, "changelist")).context["cl"].result_list]
    assert shown == ["w2"]
    forgotten = admin_client.get(url(Worker, "changelist"), {"forgotten": "yes"}).context["cl"].result_list
    assert [w.pk for w in forgotten] == ["w1"]

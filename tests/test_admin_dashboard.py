"""The admin index is Apiary's dashboard: counts by state per project/pool/agent, the last
hour's outcomes from JobEvent as an SVG chart, the oldest queued job, blocked jobs by reason,
running jobs with worker, step and elapsed time, stale and exited workers; it refreshes
itself, is branded Apiary, and VIEW SITE leads to it."""

import re

import pytest
from django.contrib.auth.models import Permission, User

from jobqueue import services
from tests.factories import claim, enqueue, instance_id, make_task, register
from workflows.models import StepRun

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("admin_fast_passwords")]


def section(page: str, element_id: str) -> str:
    match = re.search(rf'<div class="module[^"]*" id="{element_id}">(.*?)</div>', page, re.S)
    assert match, f"no section {element_id}"
    return re.sub(r"\s+", " ", match.group(1))


@pytest.fixture
def seeded(clock, queue_config):
    """Two projects' jobs: one running (with a step running), two queued, one blocked on a
    pool nobody serves, one failed and one succeeded in the last hour; a stale worker."""
    queue_config(lease_duration=300, worker_timeout=60)
    worker = register("w1", capacity=2)  # room for the queued job: backlog, not blocked
    running = enqueue(make_task(title="Fix the login page"), project="web")
    [c] = claim(worker)
    StepRun.objects.create(
        instance_id=instance_id(running), attempt_number=1, step_id="plan", status="running", started_at=clock.now()
    )
    done = enqueue(project="web")
    failed = enqueue(project="api")
    for job, outcome in ((done, "succeeded"), (failed, "failed")):
        w = register(f"tmp-{job.pk}")
        [x] = claim(w)
        services.attempt_finish(attempt_id=x.attempt_id, token=x.token, outcome=outcome)
    queued = enqueue(project="web")
    blocked = enqueue(project="api", pool="gpu")
    register("gone")
    clock.advance(95)  # running 1m 35s; tmp and gone workers stale (w1 heartbeats below)
    services.worker_heartbeat(worker_id="w1", session=worker.session)
    services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token)
    return {"running": running, "queued": queued, "blocked": blocked, "failed": failed}


def test_the_index_is_the_dashboard_with_branding_and_refresh(admin_client, seeded):
    page = admin_client.get("/admin/").content.decode()
    assert "<title>Dashboard | Apiary</title>" in page
    assert '<a href="/admin/">Apiary</a>' in page
    assert "Django administration" not in page
    assert '<meta http-equiv="refresh" content="10">' in page
    assert "<script>" not in page.split("<body", 1)[1].split("</body>")[0].replace("<script src", "")  # no inline script


def test_view_site_leads_to_the_dashboard_not_a_404(admin_client, seeded):
    page = admin_client.get("/admin/queue/job/").content.decode()
    assert '<a href="/admin/">View site</a>' in page
    response = admin_client.get("/", follow=True)
    assert response.status_code == 200 and response.redirect_chain[-1][0] == "/admin/"


def test_counts_by_state_per_project_pool_and_agent(admin_client, seeded):
    page = admin_client.get("/admin/").content.decode()
    by_project = section(page, "apiary-by-project")
    # queued leased succeeded failed cancelled total
    assert "<td>api</td><td class=\"n\">1</td><td class=\"n\">0</td><td class=\"n\">0</td><td class=\"n\">1</td>" in by_project
    assert "<td>web</td><td class=\"n\">1</td><td class=\"n\">1</td><td class=\"n\">1</td><td class=\"n\">0</td>" in by_project
    assert "<td>gpu</td>" in section(page, "apiary-by-pool")
    assert "<td>engineer</td>" in section(page, "apiary-by-agent")


def test_last_hour_chart_comes_from_job_events(admin_client, seeded):
    page = admin_client.get("/admin/").content.decode()
    hour = section(page, "apiary-hour")
    assert "succeeded 1" in hour and "failed 1" in hour and "cancelled 0" in hour
    assert "<svg" in hour and hour.count("<rect") == 2  # one minute, two outcomes stacked
    assert "1 succeeded, 1 failed, 0 cancelled" in hour


def test_oldest_queued_job_and_its_age(admin_client, seeded):
    page = admin_client.get("/admin/").content.decode()
    oldest = section(page, "apiary-hour")
    assert f"job {seeded['queued'].pk}</a>, waiting 1m 35s" in oldest


def test_blocked_jobs_grouped_by_reason(admin_client, seeded):
    blocked = section(admin_client.get("/admin/").content.decode(), "apiary-blocked")
    assert "no worker in pool gpu" in blocked
    assert f">{seeded['blocked'].pk}</a>" in blocked
    assert f">{seeded['queued'].pk}</a>" not in blocked  # ordinary backlog is not a block


def test_running_jobs_with_worker_step_and_elapsed(admin_client, seeded):
    running = section(admin_client.get("/admin/").content.decode(), "apiary-running")
    assert f">{seeded['running'].pk}</a> #1" in running
    assert "Fix the login page" in running and ">w1</a>" in running
    assert "<td>plan</td>" in running and "1m 35s" in running and "0s ago" in running


def test_stale_workers_are_listed(admin_client, seeded):
    gone = section(admin_client.get("/admin/").content.decode(), "apiary-gone-workers")
    assert ">gone</a></td><td>stale</td><td>1m 35s</td>" in gone
    assert ">w1</a>" not in gone


def test_a_staff_user_without_queue_view_sees_no_dashboard(client, seeded):
    user = User.objects.create_user("plain", password="pw", is_staff=True)
    client.force_login(user)
    page = client.get("/admin/").content.decode()
    assert "apiary-dashboard" not in page


def test_a_viewer_of_jobs_sees_it(client, seeded):
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(user)
    assert "apiary-dashboard" in client.get("/admin/").content.decode()


def test_the_dashboard_reads_in_a_fixed_number_of_queries(admin_client, clock, django_assert_max_num_queries):
    for i in range(30):
        enqueue(project=f"p{i % 3}", pool=f"pool{i % 4}")
    worker = register("w1", capacity=10)
    claim(worker, max_jobs=10)
    admin_client.get("/admin/")  # warm: session, user
    with django_assert_max_num_queries(30):
        admin_client.get("/admin/")


def test_a_remote_workers_running_step_comes_from_the_log_stream_its_attempt_has_open(admin_client, clock):
    """A remote worker's step history stays on its host; the step it streams output for is shown."""
    worker = register("remote-1")
    job = enqueue(make_task(title="Remote build"))
    [c] = claim(worker)
    services.log_append(attempt_id=c.attempt_id, token=c.token, stream="compile", offset=0, text="ok\n", final=True)
    services.log_append(attempt_id=c.attempt_id, token=c.token, stream="test", offset=0, text="running\n")
    running = section(admin_client.get("/admin/").content.decode(), "apiary-running")
    assert f">{job.pk}</a> #1" in running and "<td>test</td>" in running

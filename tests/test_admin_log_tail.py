"""The instance page's `log tail`: each step of the latest attempt, as its worker streamed it
(jobqueue/services/logs.py), preformatted and escaped, with the marker when its start was dropped."""

import pytest
from django.urls import reverse

from jobqueue import services
from jobqueue.types import MAX_LOG_CHUNK_BYTES, MAX_LOG_STREAM_BYTES
from tests.factories import claim, enqueue, instance_id, register

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def page(client, job) -> str:
    response = client.get(reverse("admin:workflows_workflowinstance_change", args=[instance_id(job)]))
    assert response.status_code == 200
    return response.content.decode()


def test_a_running_steps_log_tail_is_shown_preformatted_not_as_json(admin_client, clock):
    job = enqueue()
    [c] = claim(register("far-away"))
    services.log_append(attempt_id=c.attempt_id, token=c.token, stream="plan", offset=0, text="line one\n<b>two</b>\n")
    html = page(admin_client, job)
    assert "Log tail" in html
    assert "<strong>plan</strong> (attempt 1, worker far-away, running)" in html
    assert "<pre" in html and "line one\n&lt;b&gt;two&lt;/b&gt;\n</pre>" in html  # real newlines, escaped markup
    assert "\\n" not in html.split("Log tail", 1)[1].split("</pre>", 1)[0]


def test_an_ended_step_with_a_dropped_start_says_so(admin_client, clock):
    job = enqueue()
    [c] = claim(register("w1"))
    offset, chunk = 0, "y" * (MAX_LOG_CHUNK_BYTES - 1) + "\n"
    while offset <= MAX_LOG_STREAM_BYTES:
        offset = services.log_append(attempt_id=c.attempt_id, token=c.token, stream="build", offset=offset, text=chunk).received
    services.log_append(attempt_id=c.attempt_id, token=c.token, stream="build", offset=offset, text="the end\n", final=True)
    html = page(admin_client, job)
    assert "<strong>build</strong> (attempt 1, worker w1, ended)" in html and "the end\n</pre>" in html
    assert "yyyy" in html and html.count("y") < 5000  # a tail, not the whole MiB


def test_an_instance_without_logs_shows_a_dash(admin_client, clock):
    job = enqueue()
    html = page(admin_client, job)
    assert "—" in html.split("Log tail", 1)[1][:300]

"""`GET /healthz`: 200 while the database answers and the reaper has run
recently (its beat, written by the control plane after each reap, is newer
than max(lease_duration, 30 s)); 503 naming each problem otherwise. The
reaper's age is measured on the injected clock, so the tests move it."""

import json

import pytest
from django.db import OperationalError
from django.test import Client

from apiary_site import monitoring
from workflows import reaperbeat
from workflows.config import load
from workflows.controlplane import ControlPlane

pytestmark = pytest.mark.django_db


def healthz():
    response = Client().get("/healthz", REMOTE_ADDR="10.0.0.5")
    assert response["Content-Type"] == "application/json"
    return response.status_code, json.loads(response.content)


@pytest.fixture
def state(tmp_path, settings):
    settings.APIARY_STATE = tmp_path / ".apiary"
    return settings.APIARY_STATE


def test_a_reachable_database_and_a_recent_reap_are_healthy(clock, state):
    reaperbeat.record(state, clock.now())
    clock.advance(5)
    status, body = healthz()
    assert status == 200
    assert body["status"] == "ok" and body["database"] == "ok"
    assert body["reaper"]["seconds_ago"] == 5


def test_no_reap_ever_recorded_is_unhealthy(clock, state):
    status, body = healthz()
    assert status == 503
    assert body["status"] == "unavailable"
    assert body["database"] == "ok"
    assert [p for p in body["problems"] if p.startswith("reaper:")] == body["problems"]


def test_a_reaper_silent_past_the_lease_is_unhealthy(clock, state, queue_config):
    queue_config(lease_duration=60)
    reaperbeat.record(state, clock.now())
    clock.advance(60)
    assert healthz()[0] == 200  # at the limit: still running
    clock.advance(1)
    status, body = healthz()
    assert status == 503
    assert body["problems"] == ["reaper: last ran 61s ago (more than 60s)"]


def test_an_unreachable_database_is_unhealthy_and_its_error_stays_in_the_log(clock, state, monkeypatch, caplog):
    reaperbeat.record(state, clock.now())

    class Down:
        def cursor(self):
            raise OperationalError("could not connect to server at db.internal:5432")

    monkeypatch.setattr(monitoring, "connection", Down())
    status, body = healthz()
    assert status == 503
    assert body["database"] == "unreachable"
    assert body["problems"] == ["database: did not answer"]
    assert "db.internal" not in json.dumps(body)
    assert "db.internal" in caplog.text


def test_the_control_plane_records_its_beat_when_it_reaps(clock, tmp_path, settings):
    (tmp_path / "apiary.yaml").write_text(
        "project: p\nagents: [{id: sh, runner: shell, command: cat}]\n"
        "workflows: [{id: w, agent: sh, steps: [{id: s, run: 'true'}]}]\n"
    )
    config = load(tmp_path / "apiary.yaml")
    settings.APIARY_STATE = config.state_dir
    control = ControlPlane(config=config, clock=clock)
    control.run_once()
    assert reaperbeat.last(config.state_dir) == clock.now()
    clock.advance(100)
    assert healthz()[0] == 503  # no round since
    control.next_reap = 0.0
    control.run_once()
    assert healthz()[0] == 200

"""The control plane's loop: one bad item, a slow source, a source that always fails.

One item that cannot be stored is skipped without stopping the others; text
no database stores becomes U+FFFD; a command source runs beside the loop,
which keeps reaping leases; a source that fails on every poll still lets
`--until-idle` end, and is reported.
"""

import json
import logging
import threading
from pathlib import Path

import pytest
from django.db import DataError

from jobqueue.models import Attempt, Job
from tests.factories import claim, enqueue, register
from tests.waiting import wait_for
from workflows import controlplane as controlplane_module
from workflows import services
from workflows.config import load
from workflows.controlplane import ControlPlane
from workflows.models import Task

WAIT = 30.0  # the deadline of each wait for the loop or a source command

CONTROL_CONFIG = """
project: review
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: job, agent: sh, steps: [{id: s, run: "true"}]}]
sources:
  - {id: feed, type: command, command: %s, poll_interval: 1s, workflows: [job]}
"""


def control_plane(tmp_path: Path, command: str, clock=None) -> ControlPlane:
    (tmp_path / "apiary.yaml").write_text(CONTROL_CONFIG % json.dumps(command))
    return ControlPlane(config=load(tmp_path / "apiary.yaml"), clock=clock)


def publish(tmp_path: Path, *objects: dict) -> None:
    (tmp_path / "items.json").write_text(json.dumps(list(objects)))



def running(control: ControlPlane, condition):
    """`condition` for wait_for that runs the loop once more (`control.run_once`)
    each time it does not hold yet, as the daemon would."""

    def check():
        if condition():
            return True
        control.run_once()
        return False

    return check


@pytest.mark.django_db
def test_an_item_whose_key_does_not_fit_is_skipped_and_the_others_dispatch(tmp_path, caplog):
    control = control_plane(tmp_path, "cat items.json")
    long_key = "k" * 2000  # Task.item_key holds 1024; PostgreSQL refuses more, SQLite would store it
    publish(tmp_path, {"id": "a", "title": "A"}, {"id": long_key, "title": "too long"}, {"id": "c", "title": "C"})
    with caplog.at_level(logging.WARNING, logger="apiary.controlplane"):
        assert control.poll("feed") == 2
    assert sorted(Task.objects.values_list("item_key", flat=True)) == ["a", "c"]
    assert "feed" in caplog.text and "k" * 40 in caplog.text and long_key not in caplog.text
    assert "1024" in caplog.text


@pytest.mark.django_db
def test_an_item_whose_sync_raises_is_logged_and_skipped(tmp_path, caplog, monkeypatch):
    control = control_plane(tmp_path, "cat items.json")
    publish(tmp_path, {"id": "a"}, {"id": "poison"}, {"id": "c"})
    real_fields = services.task_fields

    def task_fields(item):  # what dispatch takes from each item, in a batch and item by item alike
        if item.key == "poison":  # stands in for what the database refuses of one row
            raise DataError("value too long for type character varying(1024)")
        return real_fields(item)

    monkeypatch.setattr(services, "task_fields", task_fields)
    with caplog.at_level(logging.WARNING, logger="apiary.controlplane"):
        assert control.poll("feed") == 2
    assert sorted(Task.objects.values_list("item_key", flat=True)) == ["a", "c"]
    assert "poison" in caplog.text and "value too long" in caplog.text


@pytest.mark.django_db
def test_nul_and_lone_surrogates_in_items_are_stored_as_replacement_characters(tmp_path):
    # PostgreSQL refuses NUL in text and jsonb; no backend can encode a lone surrogate as UTF-8.
    (tmp_path / "items.json").write_text(
        '[{"id": "a\\u0000", "title": "x\\u0000y", "body": "b\\ud800", "extra": {"k\\u0000": ["\\udfff"]}}]'
    )
    control = control_plane(tmp_path, "cat items.json")
    assert control.poll("feed") == 1
    task = Task.objects.get()
    assert (task.item_key, task.title, task.body) == ("a\ufffd", "x\ufffdy", "b\ufffd")
    assert task.payload == {"extra": {"k\ufffd": ["\ufffd"]}}
    assert control.poll("feed") == 0  # the same item again is the same task, not a new one
    assert Task.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_leases_are_reaped_while_a_command_source_is_still_running(tmp_path, clock, queue_config):
    queue_config(lease_duration=3, heartbeat_interval=1, worker_timeout=3)
    command = "echo run >> started; while [ ! -f release ]; do sleep 0.05; done; cat items.json"
    control = control_plane(tmp_path, command, clock=clock)
    publish(tmp_path, {"id": "a", "title": "A"})
    job = enqueue()
    (leased,) = claim(register("w1"))
    clock.advance(10)  # the worker died; its lease ran out

    try:
        reap_while_polling(control, tmp_path, leased, job)
    finally:
        (tmp_path / "release").touch()  # let the command end whatever happened


def reap_while_polling(control, tmp_path, leased, job):
    finished = threading.Event()
    threading.Thread(target=lambda: (control.run_once(), finished.set()), daemon=True).start()
    assert finished.wait(20), "run_once waits for the command source"
    assert Attempt.objects.get(pk=leased.attempt_id).state == "expired"
    wait_for(lambda: (tmp_path / "started").exists(), timeout=WAIT, what="the command to start")
    for _ in range(5):  # due again and again while it runs: still one command in flight
        control.next_poll["feed"] = 0.0
        control.run_once()
    assert (tmp_path / "started").read_text() == "run\n"
    assert not control.idle() and Task.objects.filter(source="feed").count() == 0

    (tmp_path / "release").touch()
    wait_for(running(control, lambda: Task.objects.filter(source="feed").exists()), timeout=WAIT,
             what="the poll's items")
    assert Job.objects.exclude(pk=job.pk).count() == 1
    assert control.failed_sources() == set()


@pytest.mark.django_db(transaction=True)
def test_a_source_failing_on_every_poll_counts_as_polled_and_is_reported(tmp_path, caplog):
    control = control_plane(tmp_path, "echo broken >&2; exit 1")
    with caplog.at_level(logging.WARNING, logger="apiary.controlplane"):
        wait_for(running(control, lambda: control.polled), timeout=WAIT, what="the first poll")
    assert control.idle()  # `--until-idle` ends; the daemon warns with failed_sources()
    assert control.failed_sources() == {"feed"}
    assert "broken" in caplog.text

    (tmp_path / "apiary.yaml").write_text(CONTROL_CONFIG % json.dumps("echo '[]'"))
    control.config = load(tmp_path / "apiary.yaml")
    assert control.poll("feed") == 0  # the synchronous poll records its verdict too
    assert control.failed_sources() == set()


@pytest.mark.django_db(transaction=True)
def test_a_source_that_raises_unexpectedly_in_its_poll_thread_is_a_failed_poll(tmp_path, monkeypatch, caplog):
    control = control_plane(tmp_path, "echo '[]'")

    def broken(source, *, cwd=None):
        raise RuntimeError("a bug in a source type")

    monkeypatch.setattr(controlplane_module.sources, "poll", broken)
    with caplog.at_level(logging.WARNING, logger="apiary.controlplane"):
        wait_for(running(control, lambda: control.polled), timeout=WAIT, what="the first poll")
    assert control.failed_sources() == {"feed"}
    assert "a bug in a source type" in caplog.text

"""With the embedded worker's group committer (`apiary run` passes it to the control
plane), a source poll's batches are written by the committer's thread, on its
connection, in its commits: the control loop's own connection writes nothing, so on
SQLite the two never wait for each other's write lock. What a batch keeps of the plain
dispatch holds through it: a bad item is skipped and the rest of its batch dispatched,
and a second poll creates nothing."""

import json
import logging

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobqueue.groupcommit import GroupCommitter
from jobqueue.models import Job
from tests.factories import snapshot
from tests.test_dispatch_batches import control_plane, every_task_has_its_instances_and_jobs, write_items
from workflows import services
from workflows.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

WRITES = ("INSERT", "UPDATE", "DELETE", "BEGIN")


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(services, "BATCH", 3)


def _with_committer(tmp_path, committer):
    control = control_plane(tmp_path)
    control.committer = committer
    return control


def test_the_batches_are_written_by_the_committer_not_the_control_loop(tmp_path, clock, small_batches):
    committer = GroupCommitter()
    control = _with_committer(tmp_path, committer)
    write_items(tmp_path, 7)
    with CaptureQueriesContext(connection) as own:
        assert control.poll("inbox") == 7
    assert every_task_has_its_instances_and_jobs()
    writes = [q["sql"] for q in own.captured_queries if q["sql"].lstrip().upper().startswith(WRITES)]
    assert writes == []  # only the reads that find what is new ran on the loop's connection
    before = snapshot()
    clock.advance(60)
    assert control.poll("inbox") == 0
    assert snapshot() == before
    committer.flush()


def test_a_bad_item_is_skipped_and_the_rest_of_its_batch_dispatched(tmp_path, clock, small_batches, caplog):
    control = _with_committer(tmp_path, GroupCommitter())
    items = [{"id": "a"}, {"id": "b"}, {"id": "c", "body": "x" * 700_000, "blob": "y" * 400_000}, {"id": "d"}]
    (tmp_path / "items.json").write_text(json.dumps(items))
    with caplog.at_level(logging.INFO, logger="apiary.controlplane"):
        assert control.poll("feed") == 3
    assert sorted(Task.objects.values_list("item_key", flat=True)) == ["a", "b", "d"]
    assert every_task_has_its_instances_and_jobs(("plain",)) and Job.objects.count() == 3
    assert "skipping item 'c'" in caplog.text and "a batch of 3 items failed" in caplog.text

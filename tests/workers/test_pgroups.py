"""The record of a worker's process groups (workers/pgroups.py): what a successor reads after
the worker was SIGKILLed is every group started and not ended, with its leader's start time,
whatever the record went through (compaction, a write cut short, an older worker's files)."""

import os
import signal
import subprocess

import pytest

from tests.waiting import wait_for
from workers import pgroups
from workers.pgroups import RECORD, ProcessGroups, process_group_alive, process_start_time, recorded


def test_the_record_holds_the_groups_started_and_not_ended_without_being_closed(tmp_path):
    groups = ProcessGroups(tmp_path)
    own = os.getpid()
    groups.add(own)
    groups.add(1)
    groups.remove(1)
    # Read as a successor would, while this object still holds the record open (the worker died).
    assert recorded(tmp_path) == {own: process_start_time(own)}
    groups.remove(own)
    assert recorded(tmp_path) == {}


def test_a_large_record_is_rewritten_with_the_live_groups_only(tmp_path, monkeypatch):
    monkeypatch.setattr(pgroups, "COMPACT_BYTES", 200)
    groups = ProcessGroups(tmp_path)
    groups.add(os.getpid())
    for pgid in range(100_000, 100_100):
        groups.add(pgid)
        groups.remove(pgid)
    assert (tmp_path / RECORD).stat().st_size <= 200 + 20
    assert recorded(tmp_path) == {os.getpid(): process_start_time(os.getpid())}
    groups.add(12345)  # the descriptor kept after the rewrite is the new record's
    assert set(recorded(tmp_path)) == {os.getpid(), 12345}


def test_a_line_cut_short_is_ignored_and_the_lines_after_it_are_read(tmp_path, monkeypatch):
    groups = ProcessGroups(tmp_path)
    groups.add(100)
    real_write = os.write

    def full_disk(fd, data):  # the disk fills after three bytes of the next line
        real_write(fd, data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pgroups.os, "write", full_disk)
    with pytest.raises(OSError):
        groups.add(4242)  # the step is not started: its group is not recorded
    monkeypatch.setattr(pgroups.os, "write", real_write)
    groups.add(200)
    assert (tmp_path / RECORD).read_text().splitlines()[1] == "+42x"  # the fragment, made malformed
    assert set(recorded(tmp_path)) == {100, 200}  # not 42, nor 4242


@pytest.mark.processes
def test_a_successor_ends_the_recorded_groups_and_those_of_an_older_worker(tmp_path):
    alive = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        groups = ProcessGroups(tmp_path)
        groups.add(alive[0].pid)  # recorded by this worker, which then dies
        (tmp_path / str(alive[1].pid)).write_text(str(process_start_time(alive[1].pid)))  # an older worker's file
        successor = ProcessGroups(tmp_path)
        assert sorted(successor.reap_orphans(grace=1.0)) == sorted(p.pid for p in alive)
        for proc in alive:
            proc.wait(timeout=10)
            wait_for(lambda pgid=proc.pid: not process_group_alive(pgid), timeout=10, what="the group to end")
        assert list(tmp_path.iterdir()) == []
    finally:
        for proc in alive:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.processes
def test_a_recorded_pid_that_another_process_has_now_is_left_alone(tmp_path):
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (tmp_path / RECORD).write_text(f"+{proc.pid} {process_start_time(proc.pid) + 1}\n")  # another leader's start
        assert ProcessGroups(tmp_path).reap_orphans(grace=1.0) == []
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

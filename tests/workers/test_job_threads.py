"""The worker's job threads (workers/jobthreads.py): a job runs on a thread that
an earlier job left idle, a run's handle says alive until its job returned, a
job that raises costs only itself, and an idle thread ends by itself."""

import threading

from tests.waiting import wait_for
from workers.jobthreads import JobThreads


def test_the_next_job_runs_on_the_thread_the_last_one_left_idle_renamed():
    pool = JobThreads(idle_seconds=30)
    seen = []
    release = threading.Event()

    def job():
        seen.append((threading.get_ident(), threading.current_thread().name))
        release.wait(10)

    first = pool.start(job, "job-1")
    wait_for(lambda: seen, timeout=10, what="the first job to start")
    assert first.is_alive()
    release.set()
    first.join(10)
    assert not first.is_alive()
    wait_for(lambda: pool._idle, timeout=10, what="its thread to be idle")
    second = pool.start(job, "job-2")
    second.join(10)
    assert not second.is_alive()
    assert [ident for ident, _ in seen] == [seen[0][0]] * 2 and [name for _, name in seen] == ["job-1", "job-2"]


def test_two_jobs_at_once_run_on_two_threads():
    pool = JobThreads(idle_seconds=30)
    both = threading.Barrier(2, timeout=10)  # each job waits for the other: they must run side by side
    runs = [pool.start(both.wait, f"job-{i}") for i in range(2)]
    for run in runs:
        run.join(10)
    assert not any(run.is_alive() for run in runs) and not both.broken


def test_a_job_that_raises_is_logged_and_its_thread_serves_the_next(caplog):
    pool = JobThreads(idle_seconds=30)
    failed = pool.start(lambda: 1 / 0, "job-bad")
    failed.join(10)
    assert not failed.is_alive() and "job-bad failed" in caplog.text
    wait_for(lambda: pool._idle, timeout=10, what="its thread to be idle again")
    done = []
    pool.start(lambda: done.append(True), "job-good").join(10)
    assert done == [True]


def test_an_idle_thread_ends_by_itself():
    pool = JobThreads(idle_seconds=0.05)
    threads = []
    pool.start(lambda: threads.append(threading.current_thread()), "job-1").join(10)
    wait_for(lambda: not threads[0].is_alive(), timeout=10, what="the idle thread to end")
    assert pool._idle == []

"""A task's state is derived from its newest generation's jobs, never stored."""

import pytest

from jobqueue import services
from tests.factories import claim, enqueue, make_task, register
from workflows.models import Task, TaskState
from workflows.selectors import task_state, task_states

pytestmark = pytest.mark.django_db


def finish(c, outcome):
    return services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome=outcome)


def test_open_then_active_then_the_state_of_the_job_that_ended_last(clock):
    task = make_task()
    assert task_state(task) == TaskState.OPEN
    a, b = enqueue(task, workflow="a"), enqueue(task, workflow="b")
    assert task_state(task) == TaskState.ACTIVE
    claims = {c.job_id: c for c in claim(register("w1", capacity=2), 2)}
    finish(claims[a.pk], "failed")
    assert task_state(task) == TaskState.ACTIVE  # b still runs
    clock.advance(1)
    finish(claims[b.pk], "succeeded")
    assert task_state(task) == TaskState.SUCCEEDED  # b ended last


def test_a_new_generation_starts_open_whatever_the_old_one_did(clock):
    task = make_task()
    services.job_cancel(job_id=enqueue(task).pk)
    assert task_state(task) == TaskState.CANCELLED
    Task.objects.filter(pk=task.pk).update(generation=2)
    task.refresh_from_db()
    assert task_state(task) == TaskState.OPEN


def test_states_of_many_tasks_take_a_fixed_number_of_queries(clock, django_assert_num_queries):
    tasks = [make_task() for _ in range(5)]
    for task in tasks[1:]:
        enqueue(task)
    services.job_cancel(job_id=enqueue(tasks[2], workflow="other").pk)
    with django_assert_num_queries(1):
        states = task_states(Task.objects.all())
    assert [states[t.pk] for t in tasks] == [TaskState.OPEN, *[TaskState.ACTIVE] * 4]

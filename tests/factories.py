"""Factories for queue tests: tasks, jobs and workers in any state at any time."""

import itertools

from jobqueue import services
from jobqueue.clock import get_clock
from jobqueue.models import Affinity, Attempt, Job, JobEvent, RequirementSet
from workers.models import Worker
from workflows.models import Task, WorkflowInstance

_serial = itertools.count(1)


def make_task(*, source: str = "inbox", item_key: str | None = None, generation: int = 1, **fields) -> Task:
    now = get_clock().now()
    return Task.objects.create(
        source=source,
        item_key=item_key or f"item-{next(_serial)}.md",
        generation=generation,
        title=fields.pop("title", "a task"),
        created_at=now,
        updated_at=now,
        **fields,
    )


def enqueue(task: Task | None = None, *, workflow: str = "triage", **kwargs):
    """Enqueue a job with sensible defaults; returns the Job."""
    task = task or make_task(source=kwargs.pop("source", "inbox"))
    kwargs.setdefault("agent", "engineer")
    kwargs.setdefault("runner", "shell")
    kwargs.setdefault("project", "demo")
    job, _ = services.job_enqueue(task=task, workflow=workflow, **kwargs)
    return job


def register(worker_id: str = "w1", *, runners=("shell",), capabilities=(), **kwargs):
    """Register a worker that can run `runners`; returns the Worker."""
    caps = ["apiary.workflow", *(f"runner:{r}" for r in runners), *capabilities]
    return services.worker_register(worker_id=worker_id, capabilities=caps, **kwargs)


def claim(worker, max_jobs: int = 1):
    return services.jobs_claim(worker_id=worker.worker_id, session=worker.session, max_jobs=max_jobs)


def snapshot() -> dict[str, list[dict]]:
    """Every row a queue call could touch, for asserting that a call changed nothing."""
    models = (Job, Attempt, JobEvent, Affinity, RequirementSet, Worker, WorkflowInstance, Task)
    return {model.__name__: list(model.objects.order_by("pk").values()) for model in models}

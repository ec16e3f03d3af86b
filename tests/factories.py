"""Factories for queue tests: tasks, jobs and workers in any state at any time."""

import itertools

from django.db import transaction

from jobqueue import services
from jobqueue.clock import get_clock
from jobqueue.models import Affinity, Attempt, Job, JobEvent, RequirementSet, Worker
from workflows import payload
from workflows.models import Task, WorkflowInstance
from workflows.selectors import task_state
from workflows.services import RUNNER_CAPABILITY, WORKFLOW_CAPABILITY, affinity_key, enqueue_key

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


def enqueue_job(task: Task, *, workflow: str = "triage", affinity: bool = False, **kwargs) -> tuple[Job, bool]:
    """A workflow job as dispatch makes it (an instance, its job with the task
    snapshot as payload, the workflow capabilities), without a config; returns
    (job, created) as job_enqueue does."""
    runner = kwargs.setdefault("runner", "shell")
    kwargs.setdefault("agent", "engineer")
    kwargs.setdefault("project", "demo")
    caps = [*kwargs.pop("capabilities", ()), WORKFLOW_CAPABILITY, RUNNER_CAPABILITY.format(adapter=runner)]
    clock = kwargs.get("clock")
    with transaction.atomic(durable=True):
        task.refresh_from_db()
        instance, made = WorkflowInstance.objects.get_or_create(
            task=task, generation=task.generation, workflow=workflow,
            defaults={"created_at": (clock or get_clock()).now()},
        )
        job, created = services.job_enqueue_in(
            key=enqueue_key(task, workflow),
            payload=payload.payload_of(workflow=workflow, instance_id=instance.pk, task=task),
            source=task.source,
            capabilities=caps,
            affinity_key=affinity_key(task.pk) if affinity else None,
            **kwargs,
        )
        if made:
            WorkflowInstance.objects.filter(pk=instance.pk).update(job=job)
    return job, created


def enqueue(task: Task | None = None, *, workflow: str = "triage", **kwargs) -> Job:
    """Enqueue a job with sensible defaults; returns the Job."""
    task = task or make_task(source=kwargs.pop("source", "inbox"))
    return enqueue_job(task, workflow=workflow, **kwargs)[0]


def task_id(job: Job) -> int:
    return job.payload["task"]["id"]


def instance_id(job: Job) -> int:
    return job.payload["instance_id"]


def instance_state(job: Job) -> str:
    """The state of the job's workflow instance, as the workflow layer reads it."""
    return WorkflowInstance.objects.select_related("job").get(pk=instance_id(job)).job.state


def task_state_of(job: Job) -> str:
    """The derived state of the job's task (workflows.selectors.task_state)."""
    return task_state(Task.objects.get(pk=task_id(job)))


def register(worker_id: str = "w1", *, runners=("shell",), capabilities=(), **kwargs):
    """Register a worker that can run `runners`; returns the Worker."""
    caps = ["apiary.workflow", "apiary.hooks", "apiary.effects", *(f"runner:{r}" for r in runners), *capabilities]
    return services.worker_register(worker_id=worker_id, capabilities=caps, **kwargs)


def claim(worker, max_jobs: int = 1):
    return services.jobs_claim(worker_id=worker.worker_id, session=worker.session, max_jobs=max_jobs)


def snapshot() -> dict[str, list[dict]]:
    """Every row a queue call could touch, for asserting that a call changed nothing."""
    models = (Job, Attempt, JobEvent, Affinity, RequirementSet, Worker, WorkflowInstance, Task)
    return {model.__name__: list(model.objects.order_by("pk").values()) for model in models}

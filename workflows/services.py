"""Tasks from source items, and their dispatch into the queue.

A task is a source item's record (not a queue row): this module creates and
updates tasks and asks `jobqueue.services.job_enqueue` for one job per
workflow of the task's current generation. Dispatch is idempotent through the
enqueue key, so polling an unchanged item again, or dispatching again after a
crash between the task write and the enqueue, creates nothing new.
"""

import logging
import uuid

from django.db import transaction

from jobqueue import services as queue
from jobqueue.clock import Clock, get_clock
from jobqueue.models import Job
from jobqueue.sql import clean

from .config import Config, SourceConfig
from .models import Task
from .sources import Item

log = logging.getLogger("apiary.dispatch")


@transaction.atomic(durable=True)
def task_sync(*, source: SourceConfig, item: Item, clock: Clock | None = None) -> tuple[Task, bool]:
    """Create or update the task for `item`; returns (task, new_generation).

    A command source's item starts a new generation whenever its content
    (including `updated_at`) changes; a directory item only with
    `redispatch_on_change: true` — otherwise its text is refreshed in place.
    """
    now = (clock or get_clock()).now()
    # NUL (refused by PostgreSQL) and lone surrogates (not UTF-8) become U+FFFD, on every backend alike.
    key = clean(item.key)
    fields = {"title": clean(item.title), "body": clean(item.body), "payload": clean(item.payload)}
    task = Task.objects.filter(source=source.id, item_key=key).first()
    if task is None:
        task = Task.objects.create(
            source=source.id, item_key=key, generation=1, content_hash=item.content_hash,
            created_at=now, updated_at=now, **fields,
        )
        return task, True
    if task.content_hash == item.content_hash:
        return task, False
    redispatch = source.type == "command" or source.redispatch_on_change
    if redispatch:
        fields["generation"] = task.generation + 1
        fields["state"] = "open"
    Task.objects.filter(pk=task.pk).update(content_hash=item.content_hash, updated_at=now, **fields)
    task.refresh_from_db()
    return task, redispatch


def task_add(*, source: str, title: str, body: str = "", payload: dict | None = None, clock: Clock | None = None) -> Task:
    """A task created by hand (`apiary task add`)."""
    now = (clock or get_clock()).now()
    return Task.objects.create(
        source=source, item_key=f"manual-{uuid.uuid4().hex[:12]}", title=clean(title), body=clean(body),
        payload=clean(payload or {}), created_at=now, updated_at=now,
    )


def dispatch(*, config: Config, task: Task, workflows: tuple[str, ...], clock: Clock | None = None) -> list[Job]:
    """Enqueue each workflow for the task's current generation; returns the jobs
    created now (an existing key creates nothing)."""
    created = []
    for workflow_id in workflows:
        key = queue.enqueue_key(task, workflow_id)
        if Job.objects.filter(key=key).exists():  # a plain read: no write lock for the common case
            continue
        workflow = config.workflows[workflow_id]
        agent = config.agents[workflow.agent]
        job, is_new = queue.job_enqueue(
            task=task,
            workflow=workflow_id,
            agent=agent.id,
            runner=agent.adapter,
            project=config.project,
            pool=agent.worker_pool,
            labels=agent.requires_labels,
            capabilities=agent.requires_capabilities,
            affinity=agent.workspace_affinity,
            priority=workflow.priority,
            max_attempts=config.settings.queue.max_attempts,
            retry=queue.Retry(
                max_attempts=workflow.retry.max_attempts,
                backoff=workflow.retry.backoff,
                backoff_max=workflow.retry.backoff_max,
            ),
            clock=clock,
        )
        if is_new:
            log.info(
                "dispatch: job %s instance %s workflow %s task %s (%s:%s generation %s)",
                job.pk, job.instance_id, workflow_id, task.pk, task.source, task.item_key, task.generation,
            )
            created.append(job)
    return created

"""Tasks from source items, and their dispatch into the queue.

A task is a source item's record (not a queue row): this module creates and
updates tasks and, per workflow of the task's current generation, creates a
workflow instance and its job in one transaction (`jobqueue.services.
job_enqueue_in`). Dispatch is idempotent through the instance's uniqueness
and the job's enqueue key, so polling an unchanged item again, or
dispatching again after a crash, creates nothing new.

A workflow with `hooks` gives its job follow-ups (jobqueue/services/
followups.py): per outcome with hooks, one hook job the queue enqueues in the
transaction that settles the instance's job in that state, under the same
routing and the workflow's retry policy, keyed `<job key>:hook:<outcome>` so
it exists at most once.
"""

import dataclasses
import logging
import uuid

from django.db import IntegrityError, transaction

from jobqueue import services as queue
from jobqueue.clock import Clock, get_clock
from jobqueue.models import Job
from jobqueue.text import clean

from . import bulk, payload
from .config import AgentConfig, Config, SourceConfig, WorkflowConfig
from .models import Task, WorkflowInstance
from .sources import Item

# Every workflow job requires these of its worker (DESIGN §3.3): a worker that
# runs workflows at all, and the job's runner adapter.
WORKFLOW_CAPABILITY = "apiary.workflow"
# Required of a worker for hook jobs: a worker from before hooks existed would read a hook job as
# its workflow and run the workflow's steps again. Only workers that know hook jobs advertise it.
HOOKS_CAPABILITY = "apiary.hooks"
# Required of a worker for a workflow job with publish or spawn steps, for the same reason: a worker
# from before effect steps would run a publish with no ledger (again after a done one) and a spawn
# step as a plain step (its children lost).
EFFECTS_CAPABILITY = "apiary.effects"
RUNNER_CAPABILITY = "runner:{adapter}"

log = logging.getLogger("apiary.dispatch")


def task_add(*, source: str, title: str, body: str = "", payload: dict | None = None, clock: Clock | None = None) -> Task:
    """A task created by hand (`apiary task add`)."""
    now = (clock or get_clock()).now()
    return Task.objects.create(
        source=source, item_key=f"manual-{uuid.uuid4().hex[:12]}", title=clean(title), body=clean(body),
        payload=clean(payload or {}), created_at=now, updated_at=now,
    )


def enqueue_key(task: Task, workflow: str) -> str:
    return f"{task.pk}:{task.generation}:{workflow}"


def hook_key(job_key: str, outcome: str) -> str:
    """The dedup key of the hook job that follows the job `job_key` ending `outcome`."""
    return f"{job_key}:hook:{outcome}"


def affinity_key(task_id: int) -> str:
    """The queue's affinity key of a task: its jobs with `workspace_affinity` share it."""
    return f"task:{task_id}"


def worker_capabilities(adapters, extra=()) -> tuple[str, ...]:
    """What a worker advertises: the workflow, hooks and effects capabilities, `runner:<adapter>`
    for every adapter whose executable it finds, and any of its own."""
    known = {WORKFLOW_CAPABILITY, HOOKS_CAPABILITY, EFFECTS_CAPABILITY}
    return tuple(sorted({*known, *(RUNNER_CAPABILITY.format(adapter=a) for a in adapters), *extra}))


@transaction.atomic(durable=True)
def instance_dispatch(
    *, config: Config, task: Task, workflow: WorkflowConfig, clock: Clock | None = None
) -> tuple[WorkflowInstance, Job, bool]:
    """One workflow on the task's current generation: the instance and its job,
    committed together. Returns (instance, job, created); an existing instance
    is returned as it is."""
    return instance_dispatch_in(config=config, task=task, workflow=workflow, clock=clock)


def instance_dispatch_in(
    *,
    config: Config,
    task: Task,
    workflow: WorkflowConfig,
    parent: WorkflowInstance | None = None,
    clock: Clock | None = None,
) -> tuple[WorkflowInstance, Job, bool]:
    """instance_dispatch in the caller's transaction (workflows.spawning
    dispatches a spawn's children with the record's marker). `parent` is the
    spawning instance of a child task's instance: stored on the instance and
    in its job's payload (`parent_instance_id`)."""
    lookup = {"task": task, "generation": task.generation, "workflow": workflow.id}
    existing = WorkflowInstance.objects.select_related("job").filter(**lookup).first()
    if existing is not None:
        return existing, existing.job, False
    now = (clock or get_clock()).now()
    try:
        with transaction.atomic():
            instance = WorkflowInstance.objects.create(created_at=now, parent=parent, **lookup)
    except IntegrityError:  # dispatched concurrently (PostgreSQL): the other one's instance and job stand
        existing = WorkflowInstance.objects.select_related("job").get(**lookup)
        return existing, existing.job, False
    job, _ = queue.job_enqueue_in(**_job_spec(config=config, task=task, workflow=workflow, instance=instance), clock=clock)
    WorkflowInstance.objects.filter(pk=instance.pk).update(job=job)
    instance.job = job
    return instance, job, True


def _job_spec(*, config: Config, task: Task, workflow: WorkflowConfig, instance: WorkflowInstance) -> dict:
    """The job of a new instance, as job_enqueue_in's keyword arguments: the payload, the agent's
    routing and the workflow's retry policy, and its hooks as follow-ups."""
    agent: AgentConfig = config.agents[workflow.agent]
    key = enqueue_key(task, workflow.id)
    parent_id = instance.parent_id
    # The instance's job and its hook jobs run under the agent's routing, with the same limits.
    routing = {
        "project": config.project,
        "source": task.source,
        "agent": agent.id,
        "runner": agent.adapter,
        "pool": agent.worker_pool,
        "labels": list(agent.requires_labels),
        "capabilities": [
            *agent.requires_capabilities, WORKFLOW_CAPABILITY, RUNNER_CAPABILITY.format(adapter=agent.adapter)
        ],
        "affinity_key": affinity_key(task.pk) if agent.workspace_affinity else None,
        "priority": workflow.priority,
        "max_attempts": config.settings.queue.max_attempts,
    }
    effects = [EFFECTS_CAPABILITY] if any(step.publish or step.spawn for step in workflow.steps) else []
    return {
        "key": key,
        "payload": payload.payload_of(
            workflow=workflow.id, instance_id=instance.pk, task=task, parent_instance_id=parent_id
        ),
        "retry": workflow.retry,
        "follow_ups": _hook_follow_ups(
            key=key, workflow=workflow, instance=instance, task=task, routing=routing, parent_instance_id=parent_id
        ),
        **routing,
        "capabilities": [*routing["capabilities"], *effects],
    }


def _hook_follow_ups(
    *,
    key: str,
    workflow: WorkflowConfig,
    instance: WorkflowInstance,
    task: Task,
    routing: dict,
    parent_instance_id: int | None = None,
) -> dict:
    """{outcome: [the hook job's spec]} for each outcome with hooks: what the queue enqueues when
    the instance's job settles in that state (a job_enqueue_in keyword dict, stored as JSON)."""
    follow_ups = {}
    for outcome in workflow.hooks:
        hook = hook_key(key, outcome)
        hook_payload = payload.hook_payload_of(
            workflow=workflow.id,
            instance_id=instance.pk,
            task=task,
            outcome=outcome,
            effect_key=payload.effect_key_of(project=routing["project"], key=hook),
            parent_instance_id=parent_instance_id,
        )
        spec = {"key": hook, "payload": hook_payload, **routing, "retry": dataclasses.asdict(workflow.retry)}
        spec["capabilities"] = [*routing["capabilities"], HOOKS_CAPABILITY]
        follow_ups[outcome] = [spec]
    return follow_ups


def dispatch(*, config: Config, task: Task, workflows: tuple[str, ...], clock: Clock | None = None) -> list[Job]:
    """Dispatch each workflow for the task's current generation; returns the
    jobs created now (an existing instance creates nothing)."""
    created = []
    for workflow_id in workflows:
        # A plain read first: no write lock for the common case of nothing new.
        if WorkflowInstance.objects.filter(task=task, generation=task.generation, workflow=workflow_id).exists():
            continue
        instance, job, is_new = instance_dispatch(
            config=config, task=task, workflow=config.workflows[workflow_id], clock=clock
        )
        if is_new:
            _log_dispatch(instance, job, task)
            created.append(job)
    return created


def _log_dispatch(instance: WorkflowInstance, job: Job, task: Task) -> None:
    log.info(
        "dispatch: job %s instance %s workflow %s task %s (%s:%s generation %s)",
        job.pk, instance.pk, instance.workflow, task.pk, task.source, task.item_key, task.generation,
    )


# Items per items_dispatch transaction: long enough to pay its commit once for many items,
# short enough that the write lock it holds on SQLite never keeps a claim or a finish waiting long.
BATCH = 500


def items_dispatch(
    *, config: Config, source: SourceConfig, items: list[Item], clock: Clock | None = None, committer=None
) -> list[Job]:
    """The tasks of a source's items (BATCH or so, unique keys) and, per workflow of the
    source, the instance and job of each task's current generation that it lacks, all in
    one transaction; returns the jobs created. A new item is a new task; a changed one is
    refreshed in place or starts a new generation (_task_refresh); an unchanged one whose
    instances exist creates nothing. Each kind of row is read and written once for the
    whole batch, never per item. Anything that fails rolls the whole batch back: nothing
    of it is written, and the caller can try its items one by one.

    With a `committer` (jobqueue.groupcommit: the embedded worker's), the batch is a call
    in its next commit, on its connection: on SQLite, one writer in the process instead of
    two taking turns at the write lock through the busy timeout's sleeps, which left the
    dispatch waiting on a busy worker. A database error reaches the caller as the
    committer answers it (an OperationalError as Unavailable)."""
    if _nothing_new(source=source, items=items):
        return []
    batch = {"config": config, "source": source, "items": items, "clock": clock}
    if committer is not None:
        made = committer.call(_dispatch_in, **batch)
    else:
        with transaction.atomic(durable=True):
            made = _dispatch_in(**batch)
    for instance, job in made:
        _log_dispatch(instance, job, instance.task)
    return [job for _, job in made]


def _dispatch_in(*, config: Config, source: SourceConfig, items: list[Item], clock: Clock | None):
    """items_dispatch's writes, in the caller's transaction: (instance, job) of each job made."""
    now = (clock or get_clock()).now()
    tasks = _tasks_sync(source=source, items=items, now=now)
    return _instances_dispatch(config=config, tasks=tasks, workflows=source.workflows, now=now, clock=clock)


_dispatch_in.body = _dispatch_in  # a call a GroupCommitter runs inside its batch's transaction


def _nothing_new(*, source: SourceConfig, items: list[Item]) -> bool:
    """Whether every item has its task, unchanged, with the instances of its current generation:
    what a poll of an unchanged source finds, told by two plain reads without the write lock."""
    keys = [clean(item.key) for item in items]
    known = {
        key: (pk, generation, content_hash)
        for key, pk, generation, content_hash in Task.objects.filter(source=source.id, item_key__in=keys).values_list(
            "item_key", "pk", "generation", "content_hash"
        )
    }
    if len(known) < len(keys) or any(known[key][2] != item.content_hash for key, item in zip(keys, items, strict=True)):
        return False
    have = set(
        WorkflowInstance.objects.filter(task__in=[pk for pk, _, _ in known.values()]).values_list(
            "task_id", "generation", "workflow"
        )
    )
    return all((pk, generation, w) in have for pk, generation, _ in known.values() for w in source.workflows)


def _tasks_sync(*, source: SourceConfig, items: list[Item], now) -> list[Task]:
    """The task of each item, in order: one read of those that exist, one insert of the new."""
    keyed = [(clean(item.key), item) for item in items]
    known = {t.item_key: t for t in Task.objects.filter(source=source.id, item_key__in=[key for key, _ in keyed])}
    tasks, new = [], []
    for key, item in keyed:
        fields = task_fields(item)
        task = known.get(key)
        if task is None:
            task = Task(
                source=source.id, item_key=key, generation=1, content_hash=item.content_hash,
                created_at=now, updated_at=now, **fields,
            )  # fmt: skip
            new.append(task)
        else:
            task = _task_refresh(task, source=source, item=item, fields=fields, now=now)
        tasks.append(task)
    bulk.insert_tasks(new)
    return tasks


def task_fields(item: Item) -> dict:
    """What a task takes from its item besides its key and hash, as both backends store it:
    NUL (refused by PostgreSQL) and lone surrogates (not UTF-8) become U+FFFD."""
    return {"title": clean(item.title), "body": clean(item.body), "payload": clean(item.payload)}


def _task_refresh(task: Task, *, source: SourceConfig, item: Item, fields: dict, now) -> Task:
    """The task of an item it had before: unchanged, refreshed in place, or on a new generation.

    A command source's item starts a new generation whenever its content
    (including `updated_at`) changes; a directory item only with
    `redispatch_on_change: true` — otherwise its text is refreshed in place."""
    if task.content_hash == item.content_hash:
        return task
    if source.type == "command" or source.redispatch_on_change:
        fields = {**fields, "generation": task.generation + 1}
    fields |= {"content_hash": item.content_hash, "updated_at": now}
    Task.objects.filter(pk=task.pk).update(**fields)
    for name, value in fields.items():
        setattr(task, name, value)
    return task


def _instances_dispatch(
    *, config: Config, tasks: list[Task], workflows: tuple[str, ...], now, clock: Clock | None
) -> list[tuple[WorkflowInstance, Job]]:
    """dispatch of many tasks: one read of the instances they have, one insert of those they lack,
    their jobs in jobs_enqueue_in (dedup by enqueue key, one wake per job class), one update linking them."""
    have = set(
        WorkflowInstance.objects.filter(task__in=[t.pk for t in tasks]).values_list("task_id", "generation", "workflow")
    )
    instances = [
        WorkflowInstance(task=task, generation=task.generation, workflow=workflow_id, created_at=now)
        for task in tasks
        for workflow_id in workflows
        if (task.pk, task.generation, workflow_id) not in have
    ]
    if not instances:
        return []
    bulk.insert_instances(instances)
    specs = [
        _job_spec(config=config, task=i.task, workflow=config.workflows[i.workflow], instance=i) for i in instances
    ]
    for instance, (job, _) in zip(instances, queue.jobs_enqueue_in(specs, clock=clock), strict=True):
        instance.job = job
    bulk.link_jobs(instances)
    return [(instance, instance.job) for instance in instances]

"""Spawn: a spawn step's children become tasks, once (issue 10).

The worker records a spawn step's validated JSON lines in its job's journal
as `spawn:<step>` = done `{"children": [{"id", "title", "body"?, "payload"?,
"workflows"?}]}`. Only the job's current attempt can write it and `done` is
final, so the record exists once, whatever crashed and re-ran. The control
plane's loop (ControlPlane.materialise) turns each done spawn record into
tasks here: the journal is the outbox, and a `Spawn` row, written in the
transaction that creates the children, marks the record as taken.

For each child of the record of instance I (task T, workflow W, step S):

* the task: source T.source (the spawning task's source family), key
  `<T.item_key>/<W>/<S>/<child id>` (the issue's "parent task key + child
  id", with the workflow and step so that two spawn steps naming the same
  child id make two children; ids hold no "/", so the key reads back
  unambiguously), title, body and payload the child's. A spawned task has no
  source poll: a later record naming the same child (a later generation of T
  spawning it again) with other content starts its next generation, with the
  same content it changes nothing;
* its workflows: the child's `workflows`, by default the parent source's
  (`config.sources[T.source].workflows`); a name that is no workflow of the
  config is logged and skipped, the others go;
* each instance dispatched records I as its `parent` (and its job's payload
  `parent_instance_id`, which `apiary status` shows).

One durable transaction per record: the children's tasks, instances and jobs
and the marker commit together, so a crash or restart in between leaves the
record to do again, and doing it again creates nothing twice (the marker, the
unique task key, the unique instance per task generation and workflow).
A child the database or the payload bounds refuse is logged and skipped; the
others of its record go.
"""

import hashlib
import json
import logging

from django.db import DatabaseError, DataError, IntegrityError, transaction
from django.db.models import Exists, OuterRef

from jobqueue import services as queue
from jobqueue.clock import Clock, get_clock
from jobqueue.models import JobRecord, RecordState
from jobqueue.text import clean
from jobqueue.types import WORKER_ID_RE

from . import payload, services
from .config import Config
from .models import Spawn, Task, WorkflowInstance

log = logging.getLogger("apiary.spawn")

SPAWN_PREFIX = "spawn:"  # the journal key of a spawn step's children: spawn:<step id>
SPAWN_KIND = SPAWN_PREFIX.removesuffix(":")  # those records' JobRecord.kind
BATCH = 100  # records materialised per call, at most
ITEM_KEY_MAX = Task._meta.get_field("item_key").max_length


def _pending():
    """Done spawn records no Spawn row marks, oldest first."""
    taken = Spawn.objects.filter(job_id=OuterRef("job_id"), key=OuterRef("key"))
    return (
        JobRecord.objects.filter(state=RecordState.DONE, kind=SPAWN_KIND)  # index jobrecord_done_kind
        .exclude(Exists(taken))
        .order_by("id")
    )


def spawns_pending() -> bool:
    """Whether a done spawn record waits to be materialised."""
    return _pending().exists()


def spawns_materialise(*, config: Config, clock: Clock | None = None, limit: int = BATCH) -> int:
    """Materialise up to `limit` done spawn records, each in its own
    transaction; returns the records materialised. A record that fails
    (the database) is logged and left for the next call."""
    done = 0
    for job_id, key in list(_pending().values_list("job_id", "key")[:limit]):
        try:
            if spawn_materialise(config=config, job_id=job_id, key=key, clock=clock) is not None:
                done += 1
        except DatabaseError as exc:
            log.error("spawn: job %s %s: cannot materialise it now, will retry: %s", job_id, key, exc)
    return done


@transaction.atomic(durable=True)
def spawn_materialise(*, config: Config, job_id: int, key: str, clock: Clock | None = None) -> Spawn | None:
    """The children of job `job_id`'s done record `key` as tasks, dispatched;
    returns the marker, None when the record is already materialised or is
    not a done spawn record."""
    if Spawn.objects.filter(job_id=job_id, key=key).exists():
        return None
    record = queue.record_of_job(job_id, key)
    if record is None or record.state != RecordState.DONE or not key.startswith(SPAWN_PREFIX):
        return None
    now = (clock or get_clock()).now()
    step = key.removeprefix(SPAWN_PREFIX)
    parent = WorkflowInstance.objects.select_related("task").filter(job_id=job_id).first()
    children = record.value.get("children") if isinstance(record.value, dict) else None
    taken = 0
    workflow = config.workflows.get(parent.workflow) if parent is not None else None
    declared = workflow is not None and any(s.id == step and s.spawn for s in workflow.steps)
    if parent is None:
        log.warning("spawn: job %s %s: the job is no workflow instance's; its children are not made", job_id, key)
    elif not declared:
        # The worker's record is taken as what a spawn step output only where apiary.yaml here has that
        # step: a worker (or a stolen credential) cannot make tasks for a workflow that spawns nothing.
        log.warning(
            "spawn: instance %s %s: workflow %s has no spawn step %r in this control plane's apiary.yaml; "
            "its children are not made", parent.pk, key, parent.workflow, step,
        )  # fmt: skip
    elif not isinstance(children, list):
        log.error("spawn: job %s %s: the record holds no list of children; nothing is made", job_id, key)
    else:
        for child in children:
            taken += _child(config=config, parent=parent, step=step, child=child, clock=clock)
    return Spawn.objects.create(job_id=job_id, key=key, instance=parent, children=taken, materialised_at=now)


def child_key(parent: Task, *, workflow: str, step: str, child_id: str) -> str:
    """The item key of a spawned child: see the module docstring."""
    return f"{parent.item_key}/{workflow}/{step}/{child_id}"


def _invalid(child) -> str | None:
    """Why `child` is not a child a worker records (None when it is)."""
    if not isinstance(child, dict):
        return "it is no JSON object"
    child_id = child.get("id")
    if not isinstance(child_id, str) or not WORKER_ID_RE.fullmatch(child_id):
        return "its id is not 1–128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit"
    if not isinstance(child.get("title"), str):
        return "its title is not text"
    if not isinstance(child.get("body", ""), str):
        return "its body is not text"
    if not isinstance(child.get("payload", {}), dict):
        return "its payload is not a JSON object"
    workflows = child.get("workflows")
    if workflows is not None and not (isinstance(workflows, list) and all(isinstance(w, str) for w in workflows)):
        return "its workflows are not a list of workflow ids"
    return None


def _child(*, config: Config, parent: WorkflowInstance, step: str, child, clock: Clock | None) -> int:
    """One child: its task and its instances, in a savepoint of the record's
    transaction; 1 when it was taken, 0 when it was skipped (logged)."""
    where = f"spawn: instance {parent.pk} step {step}"
    reason = _invalid(child)
    if reason is not None:
        log.warning("%s: skipping child %.80r: %s", where, child.get("id") if isinstance(child, dict) else child, reason)
        return 0
    key = child_key(parent.task, workflow=parent.workflow, step=step, child_id=child["id"])
    if len(key) > ITEM_KEY_MAX:
        log.warning(
            "%s: skipping child %s: its task key would be %d characters, a task key holds at most %d",
            where, child["id"], len(key), ITEM_KEY_MAX,
        )  # fmt: skip
        return 0
    workflows = child.get("workflows")
    if workflows is None:
        source = config.sources.get(parent.task.source)
        if source is None:
            log.warning(
                "%s: child %s names no workflows and source %r is not configured: its task runs nothing",
                where, child["id"], parent.task.source,
            )  # fmt: skip
        workflows = source.workflows if source is not None else ()
    try:
        with transaction.atomic():
            task = _task_of(parent=parent.task, key=key, child=child, clock=clock)
            for workflow_id in workflows:
                workflow = config.workflows.get(workflow_id)
                if workflow is None:
                    log.warning(
                        "%s: child %s: skipping workflow %r: no such workflow (known: %s)",
                        where, child["id"], workflow_id, ", ".join(config.workflows) or "none",
                    )  # fmt: skip
                    continue
                instance, job, created = services.instance_dispatch_in(
                    config=config, task=task, workflow=workflow, parent=parent, clock=clock
                )
                if created:
                    log.info(
                        "spawn: job %s instance %s workflow %s task %s (%s:%s), child of instance %s",
                        job.pk, instance.pk, workflow_id, task.pk, task.source, task.item_key, parent.pk,
                    )  # fmt: skip
    except (IntegrityError, DataError, ValueError) as exc:  # this child's data; payload.PayloadError is a ValueError
        # Anything else (a locked or lost database) rolls the whole record back for the next call.
        log.error("%s: skipping child %s: cannot store it: %s", where, child["id"], exc)
        return 0
    return 1


def _task_of(*, parent: Task, key: str, child: dict, clock: Clock | None) -> Task:
    """The child's task, created, or moved to its next generation when its content changed."""
    fields = {
        "title": clean(child["title"]),
        "body": clean(child.get("body", "")),
        "payload": clean(child.get("payload", {})),
    }
    payload.task_payload_check(fields["payload"], what=f"child {child['id']}'s payload")
    digest = hashlib.sha256(
        json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ).hexdigest()
    now = (clock or get_clock()).now()
    task = Task.objects.filter(source=parent.source, item_key=key).first()
    if task is None:
        return Task.objects.create(
            source=parent.source, item_key=key, generation=1, content_hash=digest,
            created_at=now, updated_at=now, **fields,
        )  # fmt: skip
    if task.content_hash != digest:
        Task.objects.filter(pk=task.pk).update(
            content_hash=digest, generation=task.generation + 1, updated_at=now, **fields
        )
        task.refresh_from_db()
    return task

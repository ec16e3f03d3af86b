"""The payload of a workflow job: what a worker needs to run it, written at
dispatch and never changed.

The queue stores it without reading it. It holds the workflow id, the
instance id and a snapshot of the task as it was when the job was
dispatched: every attempt of a job runs the same input, and a claim joins no
workflow table. (A directory item edited in place, without a new generation,
changes the task row but not the jobs already dispatched for it; set
`redispatch_on_change: true` on the source to run the new text.)
"""

import dataclasses
import re

from jobqueue import jsonlimits
from jobqueue.types import Claim

from .config.schema import ID_PATTERN, MAX_ID_LENGTH

# A task's own payload (front matter fields, a command item's extra keys, `task add --payload`)
# sits two levels down in its job's payload (`task.payload`), and a job's payload sits two levels
# down in a claim answer (`jobs[i]`): half the protocol's bound (jobqueue.jsonlimits.MAX_DEPTH)
# leaves room for both.
TASK_PAYLOAD_DEPTH = jsonlimits.MAX_DEPTH // 2
TASK_PAYLOAD_CAP = 512 * 1024  # bytes of a task's payload as JSON
# Bytes of a job's whole payload as JSON (the task snapshot: title, body, payload): the protocol's
# default body limit, so a claim answer carrying one job is never larger than what a worker may send.
JOB_PAYLOAD_CAP = 1024 * 1024


class PayloadError(ValueError):
    """A claimed job whose payload is not a workflow job's (a foreign or damaged job),
    or a payload over its bounds."""


def task_payload_check(value: dict, *, what: str = "the task payload") -> None:
    """PayloadError when a task's payload nests deeper than TASK_PAYLOAD_DEPTH,
    is larger than TASK_PAYLOAD_CAP as JSON, or holds NaN/Infinity."""
    try:
        jsonlimits.check(value, max_depth=TASK_PAYLOAD_DEPTH, max_bytes=TASK_PAYLOAD_CAP)
    except jsonlimits.JSONLimitError as exc:
        raise PayloadError(f"{what}: {exc} (TASK_PAYLOAD_DEPTH {TASK_PAYLOAD_DEPTH}, TASK_PAYLOAD_CAP {TASK_PAYLOAD_CAP})") from None


@dataclasses.dataclass(frozen=True)
class WorkflowJob:
    workflow: str
    instance_id: int
    task: dict


def task_snapshot(task) -> dict:
    return {
        "id": task.pk,
        "source": task.source,
        "item_key": task.item_key,
        "generation": task.generation,
        "title": task.title,
        "body": task.body,
        "payload": task.payload,
    }


def payload_of(*, workflow: str, instance_id: int, task) -> dict:
    """The job's payload; PayloadError when it is over JOB_PAYLOAD_CAP or nests too deep."""
    job_payload = {"workflow": workflow, "instance_id": instance_id, "task": task_snapshot(task)}
    try:
        jsonlimits.check(job_payload, max_depth=TASK_PAYLOAD_DEPTH + 2, max_bytes=JOB_PAYLOAD_CAP)
    except jsonlimits.JSONLimitError as exc:
        raise PayloadError(f"task {task.pk}: the job payload is {exc} (JOB_PAYLOAD_CAP {JOB_PAYLOAD_CAP})") from None
    return job_payload


def read(claim: Claim) -> WorkflowJob:
    """The workflow job a claim carries; PayloadError names what is missing or
    not what dispatch writes (payload_of): a workflow id, an instance id and a
    task whose id, source and generation are what a Task row holds."""
    p = claim.payload if isinstance(claim.payload, dict) else {}
    workflow, instance_id, task = p.get("workflow"), p.get("instance_id"), p.get("task")
    if not isinstance(workflow, str) or not _ID_RE.match(workflow) or not _row_id(instance_id):
        raise PayloadError(f"job {claim.job_id}: its payload has no workflow and instance id")
    # The task and instance ids become path parts of the workspace and the logs.
    if not isinstance(task, dict) or not _row_id(task.get("id")):
        raise PayloadError(f"job {claim.job_id}: its payload has no task")
    for key, valid in _TASK_FIELDS.items():
        if key in task and not valid(task[key]):
            raise PayloadError(f"job {claim.job_id}: its payload's task.{key} is not what dispatch writes")
    return WorkflowJob(workflow=workflow, instance_id=instance_id, task=task)


_ID_RE = re.compile(ID_PATTERN + r"\Z")
_MAX_ROW_ID = 2**63 - 1  # a 64-bit primary key


def _row_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_ROW_ID


_TASK_FIELDS = {
    "source": lambda v: isinstance(v, str) and len(v) <= MAX_ID_LENGTH,  # a source id, or a `task add --source` label
    "item_key": lambda v: isinstance(v, str),
    "generation": _row_id,
    "title": lambda v: isinstance(v, str),
    "body": lambda v: isinstance(v, str),
    "payload": lambda v: isinstance(v, dict),
}

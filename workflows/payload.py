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

from jobqueue.types import Claim


class PayloadError(ValueError):
    """A claimed job whose payload is not a workflow job's (a foreign or damaged job)."""


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
    return {"workflow": workflow, "instance_id": instance_id, "task": task_snapshot(task)}


def read(claim: Claim) -> WorkflowJob:
    """The workflow job a claim carries; PayloadError names what is missing."""
    p = claim.payload if isinstance(claim.payload, dict) else {}
    workflow, instance_id, task = p.get("workflow"), p.get("instance_id"), p.get("task")
    if not isinstance(workflow, str) or not _positive_int(instance_id):
        raise PayloadError(f"job {claim.job_id}: its payload has no workflow and instance id")
    # The task and instance ids become path parts of the workspace and the logs.
    if not isinstance(task, dict) or not _positive_int(task.get("id")):
        raise PayloadError(f"job {claim.job_id}: its payload has no task")
    return WorkflowJob(workflow=workflow, instance_id=instance_id, task=task)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1

"""An instance's step logs, as its attempts streamed them to the control plane.

The queue keeps opaque log streams per attempt (jobqueue/services/logs.py);
this layer says what they are: the executor names each stream after the
step's history id (`plan`; `hook:<outcome>:<step>` for a hook job's steps),
so an instance's logs are the streams of its own job and of its hook jobs.
The embedded worker and remote ones stream the same way, so this is every
step's log wherever it ran. `GET instances/{id}/logs…` (workflows/api.py),
`apiary logs` and the admin's log tail read these. Nothing here writes.
"""

from jobqueue import selectors
from jobqueue.exceptions import NotFound
from jobqueue.models import Attempt, AttemptState, Job
from jobqueue.types import MAX_LOG_STREAM_BYTES

from . import selectors as selectors_of_workflows
from .models import WorkflowInstance

HOOK_PREFIX = "hook:"


def _jobs_of(instance: WorkflowInstance) -> list[tuple[Job, str | None]]:
    """(job, hook outcome or None): the instance's own job, then its hook jobs."""
    jobs = [(instance.job, None)] if instance.job_id else []
    hooks = selectors_of_workflows.hook_jobs_of(instance)
    return jobs + [(job, (job.payload.get("hook") or {}).get("outcome")) for job in hooks]


def _instance(instance_id: int) -> WorkflowInstance:
    instance = WorkflowInstance.objects.select_related("job").filter(pk=instance_id).first()
    if instance is None:
        raise NotFound(f"there is no workflow instance {instance_id}")
    return instance


def instance_logs(*, instance_id: int) -> dict:
    """The `GET instances/{id}/logs` document: every step log of the instance, by job and attempt,
    in the order they began. NotFound for an unknown instance."""
    instance = _instance(instance_id)
    steps = []
    for job, hook in _jobs_of(instance):
        attempts = {a.number: a for a in Attempt.objects.filter(job_id=job.pk)}
        for stream in selectors.log_streams(job_id=job.pk):
            attempt = attempts.get(stream.attempt_number)
            steps.append({
                "step": stream.name,
                "job_id": job.pk,
                "hook": hook,
                "attempt_number": stream.attempt_number,
                "attempt_state": attempt.state if attempt else AttemptState.EXPIRED,
                "worker_id": attempt.worker_id if attempt else "",
                "received": stream.received,
                "dropped": stream.dropped,
                "ended": stream.ended,
                "started_at": selectors.rfc3339(stream.created_at),
                "updated_at": selectors.rfc3339(stream.updated_at),
            })  # fmt: skip
    job = instance.job
    return {
        "instance_id": instance.pk,
        "workflow": instance.workflow,
        "job_id": job.pk if job else None,
        "state": job.state if job else None,
        "attempt_number": selectors.latest_attempt_number(job_id=job.pk) if job else None,
        "steps": steps,
    }


def _job_of_step(instance: WorkflowInstance, step: str) -> Job:
    """The job whose attempt streamed `step`: a hook step's hook job, else the instance's own."""
    if step.startswith(HOOK_PREFIX):
        outcome = step[len(HOOK_PREFIX) :].partition(":")[0]
        for job, hook in _jobs_of(instance):
            if hook == outcome:
                return job
    elif instance.job_id:
        return instance.job
    raise NotFound(f"instance {instance.pk} has no step log {step!r}")


def instance_log_text(*, instance_id: int, attempt_number: int, step: str, offset: int = 0) -> dict:
    """The `GET instances/{id}/logs/{attempt}/{step}/{offset}` document: the step's log from
    `offset` (or from the first byte kept, when that is later), up to `next_offset`."""
    instance = _instance(instance_id)
    job = _job_of_step(instance, step)
    try:
        text = selectors.log_read(job_id=job.pk, attempt_number=attempt_number, stream=step, offset=offset)
    except NotFound:
        raise NotFound(f"instance {instance_id} attempt {attempt_number} has no log of step {step!r}") from None
    attempt = Attempt.objects.filter(job_id=job.pk, number=attempt_number).values_list("state", flat=True).first()
    return {
        "step": step,
        "attempt_number": attempt_number,
        "attempt_state": attempt or AttemptState.EXPIRED,
        "offset": text.offset,
        "text": text.text,
        "next_offset": text.next_offset,
        "received": text.received,
        "dropped": text.dropped,
        "ended": text.ended,
    }


def dropped_marker(dropped: int) -> str:
    """What a reader prints where the kept part of a log begins after `dropped` bytes were not kept."""
    return (
        f"[apiary: the first {dropped} bytes of this step's log were dropped: the control plane keeps the last "
        f"{MAX_LOG_STREAM_BYTES // 1024} KiB of each step; the whole log is in the step's log file on its worker]\n"
    )


def tail(*, job_id: int, attempt_number: int, step: str, received: int, dropped: int, size: int) -> str:
    """The last `size` bytes (about) of a step's log, with the marker when text before them was dropped."""
    start = max(received - size, dropped)
    text = selectors.log_read(job_id=job_id, attempt_number=attempt_number, stream=step, offset=start, limit=size)
    return (dropped_marker(dropped) if dropped and start == dropped else "") + text.text


__all__ = ["dropped_marker", "instance_log_text", "instance_logs", "tail"]

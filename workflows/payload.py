"""The payload of a workflow job: what a worker needs to run it, written at
dispatch and never changed.

The queue stores it without reading it. It holds the workflow id, the
instance id and a snapshot of the task as it was when the job was
dispatched: every attempt of a job runs the same input, and a claim joins no
workflow table. (A directory item edited in place, without a new generation,
changes the task row but not the jobs already dispatched for it; set
`redispatch_on_change: true` on the source to run the new text.)

A hook job (issue 10) carries the same three keys, of the instance whose
outcome it follows, and `hook`: {"outcome", "effect_key"}. It names its steps
by reference (the workflow id and the outcome: `WorkflowConfig.hooks[outcome]`
of the worker's apiary.yaml), as a workflow job names its steps, rather than
copying them: one source of truth for what a step is, a payload that stays
small, and the same rule for a config edited before the job runs. The hook
payload is written at dispatch, as a follow-up of the instance's job
(workflows.services.instance_dispatch), and enqueued by the queue in the
transaction that settles that job. `effect_key` is what the executor sets as
APIARY_EFFECT_KEY (stable across the hook job's attempts, retries and
workers: it is stored, not derived at run time); `outcome` is
APIARY_HOOK_OUTCOME. The steps of one hook share the key (APIARY_STEP_ID
tells them apart).

The job of a spawned child's instance (workflows.spawning), and its hook jobs,
also carry `parent_instance_id`: the spawning instance, for `apiary status`
(jobqueue.selectors.status.payload_refs reads it by name). The worker ignores it.
"""

import dataclasses
import hashlib
import re

from jobqueue import jsonlimits
from jobqueue.types import Claim

from .config.schema import HOOK_KEYS, ID_PATTERN, MAX_ID_LENGTH

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


# The terminal job states a hook runs for: APIARY_HOOK_OUTCOME's values.
HOOK_OUTCOMES = tuple(HOOK_KEYS.values())


@dataclasses.dataclass(frozen=True)
class HookJob:
    """The hook that follows instance `instance_id` of `workflow` ending `outcome`:
    its steps are `config.workflows[workflow].hooks[outcome]`."""

    workflow: str
    instance_id: int
    task: dict  # the instance's task snapshot, as its job carried it
    outcome: str  # succeeded | failed | cancelled: APIARY_HOOK_OUTCOME
    effect_key: str  # APIARY_EFFECT_KEY


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


def _parent(parent_instance_id: int | None) -> dict:
    # A spawned child's instance names its parent instance (status shows it); others carry no key.
    return {} if parent_instance_id is None else {"parent_instance_id": parent_instance_id}


def payload_of(*, workflow: str, instance_id: int, task, parent_instance_id: int | None = None) -> dict:
    """The job's payload; PayloadError when it is over JOB_PAYLOAD_CAP or nests too deep."""
    return _checked(
        task,
        {"workflow": workflow, "instance_id": instance_id, "task": task_snapshot(task), **_parent(parent_instance_id)},
    )


def effect_key_of(*, project: str, key: str) -> str:
    """A hook's APIARY_EFFECT_KEY: a digest of the project and the hook job's dedup key,
    so it is the same for every attempt of that one job and differs between projects."""
    return hashlib.sha256(f"{project}\0{key}".encode()).hexdigest()[:32]


def step_effect_key(*, project: str, job: WorkflowJob, step_id: str) -> str:
    """APIARY_EFFECT_KEY of an effect step (publish, spawn) of a workflow job: effect_key_of the
    project and the instance's job key as dispatch writes it (task:generation:workflow, from the
    payload's task snapshot) with the step id: the same for every attempt, retry and worker of
    that instance's step, different for every other step, instance and project."""
    key = f"{job.task['id']}:{job.task.get('generation', '')}:{job.workflow}:step:{step_id}"
    return effect_key_of(project=project, key=key)


def hook_payload_of(
    *, workflow: str, instance_id: int, task, outcome: str, effect_key: str, parent_instance_id: int | None = None
) -> dict:
    """The payload of the hook job that follows the instance ending `outcome`; PayloadError as payload_of's."""
    if outcome not in HOOK_OUTCOMES:
        raise ValueError(f"a hook outcome is one of {', '.join(HOOK_OUTCOMES)}, got {outcome!r}")
    hook = {"outcome": outcome, "effect_key": effect_key}
    job_payload = {"workflow": workflow, "instance_id": instance_id, "task": task_snapshot(task), "hook": hook}
    return _checked(task, {**job_payload, **_parent(parent_instance_id)})


def _checked(task, job_payload: dict) -> dict:
    try:
        jsonlimits.check(job_payload, max_depth=TASK_PAYLOAD_DEPTH + 2, max_bytes=JOB_PAYLOAD_CAP)
    except jsonlimits.JSONLimitError as exc:
        raise PayloadError(f"task {task.pk}: the job payload is {exc} (JOB_PAYLOAD_CAP {JOB_PAYLOAD_CAP})") from None
    return job_payload


def read(claim: Claim) -> WorkflowJob | HookJob:
    """The workflow job or hook job a claim carries (a hook job has a `hook`
    key); PayloadError names what is missing or not what dispatch writes
    (payload_of, hook_payload_of): a workflow id, an instance id and a task
    whose id, source and generation are what a Task row holds, and for a hook
    an outcome and an effect key."""
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
    if "hook" not in p:
        return WorkflowJob(workflow=workflow, instance_id=instance_id, task=task)
    hook = p["hook"]
    outcome = hook.get("outcome") if isinstance(hook, dict) else None
    if outcome not in HOOK_OUTCOMES:
        raise PayloadError(f"job {claim.job_id}: its payload's hook has no outcome ({', '.join(HOOK_OUTCOMES)})")
    effect_key = hook.get("effect_key")
    # The effect key becomes an environment value: the shape of an id, as effect_key_of writes it.
    if not isinstance(effect_key, str) or not _ID_RE.match(effect_key) or len(effect_key) > MAX_ID_LENGTH:
        raise PayloadError(f"job {claim.job_id}: its payload's hook.effect_key is not what dispatch writes")
    return HookJob(workflow=workflow, instance_id=instance_id, task=task, outcome=outcome, effect_key=effect_key)


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

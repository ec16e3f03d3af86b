"""Read-only questions about tasks and instances. A task's and an instance's
state are read from their jobs, never from a copy."""

from django.db.models import Case, CharField, Exists, F, OuterRef, QuerySet, Subquery, Value, When

from jobqueue.models import TERMINAL_JOB_STATES, Job, JobState, LogStream
from jobqueue.types import OUTCOMES

from .models import StepRun, Task, TaskState, WorkflowInstance
from .services import hook_key

RUNNING = "running"


def instance_state(job: Job | None) -> str:
    """An instance's state as an operator reads it: its job's, but `running` while the job is
    leased (an attempt holds it), and `—` before dispatch gave it one."""
    if job is None:
        return "—"
    if job.state == JobState.LEASED:
        return f"{RUNNING} (cancel requested)" if job.cancel_requested_at else RUNNING
    return job.state


def current_steps(instance_ids) -> dict[int, str]:
    """{instance id: the step it runs now}: from the step history the embedded worker writes,
    else (a remote worker, whose history stays on its host) from the log stream its current
    attempt has open (every worker streams each running step). At most three queries."""
    ids = list(instance_ids)
    rows = (
        StepRun.objects.filter(instance_id__in=ids, status=RUNNING, ended_at__isnull=True)
        .order_by("instance_id", "attempt_number", "started_at", "id")
        .values_list("instance_id", "step_id")
    )
    steps = dict(rows)  # the newest running step of each instance wins
    rest = [i for i in ids if i not in steps]
    if rest:
        instance_of_job = dict(WorkflowInstance.objects.filter(pk__in=rest, job__isnull=False).values_list("job_id", "pk"))
        streams = (
            LogStream.objects.filter(job_id__in=list(instance_of_job), ended=False, attempt_id=F("job__current_attempt_id"))
            .order_by("id")
            .values_list("job_id", "name")
        )
        steps.update({instance_of_job[job_id]: name for job_id, name in streams})  # the newest open stream wins
    return steps


def summary_steps(job: Job | None) -> list[dict]:
    """The steps a job's last finished attempt reported in its summary (a remote worker's only
    account of them on the control plane): [{"id", "status", "exit_code", "duration",
    "output_tail", "error"}]; [] when it reported none."""
    summary = job.summary if job is not None and isinstance(job.summary, dict) else {}
    steps = summary.get("steps") if isinstance(summary.get("steps"), list) else []
    return [
        {key: step.get(key) for key in ("id", "status", "exit_code", "duration", "output_tail", "error", "reused")}
        for step in steps
        if isinstance(step, dict)
    ]


def instance_of(*, instance_id: int) -> WorkflowInstance | None:
    return WorkflowInstance.objects.select_related("job").filter(pk=instance_id).first()


def with_state(tasks: QuerySet[Task]) -> QuerySet[Task]:
    """`tasks` annotated with `state` (TaskState), in the same query: open
    without a job for the newest generation, active while one of them is
    queued or leased, else the state of the one that ended last."""
    newest = WorkflowInstance.objects.filter(task=OuterRef("pk"), generation=OuterRef("generation"), job__isnull=False)
    return tasks.annotate(
        live_job=Exists(newest.exclude(job__state__in=TERMINAL_JOB_STATES)),
        last_state=Subquery(newest.order_by("-job__finished_at", "-job_id").values("job__state")[:1]),
    ).annotate(
        state=Case(
            When(live_job=True, then=Value(TaskState.ACTIVE)),
            When(last_state__isnull=False, then=F("last_state")),
            default=Value(TaskState.OPEN),
            output_field=CharField(),
        )
    )


def task_states(tasks: QuerySet[Task] | None = None) -> dict[int, str]:
    """{task id: TaskState} for `tasks` (default: all), in one query."""
    rows = with_state(Task.objects.all() if tasks is None else tasks).values_list("pk", "state")
    return {pk: TaskState(state) for pk, state in rows}


def task_state(task: Task) -> str:
    return task_states(Task.objects.filter(pk=task.pk))[task.pk]


def hook_jobs_of(instance: WorkflowInstance) -> list[Job]:
    """The instance's hook jobs, oldest first: found by their keys (services.hook_key), which
    the job table's unique index answers, not by reading every job's payload."""
    if instance.job is None:
        return []
    keys = [hook_key(instance.job.key, outcome) for outcome in OUTCOMES]
    return list(Job.objects.filter(key__in=keys).order_by("pk"))

"""Read-only questions about tasks and instances. A task's and an instance's
state are read from their jobs, never from a copy."""

from django.db.models import Case, CharField, Exists, F, OuterRef, QuerySet, Subquery, Value, When

from jobqueue.models import TERMINAL_JOB_STATES

from .models import Task, TaskState, WorkflowInstance


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

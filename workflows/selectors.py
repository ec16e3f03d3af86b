"""Read-only questions about tasks and instances. A task's and an instance's
state are read from their jobs, never from a copy."""

from django.db.models import F, QuerySet

from jobqueue.models import TERMINAL_JOB_STATES

from .models import Task, TaskState, WorkflowInstance


def instance_of(*, instance_id: int) -> WorkflowInstance | None:
    return WorkflowInstance.objects.select_related("job").filter(pk=instance_id).first()


def task_states(tasks: QuerySet[Task] | None = None) -> dict[int, str]:
    """{task id: TaskState} from the jobs of each task's newest generation: open
    without any, active while one is queued or leased, else the state of the
    one that ended last. Two queries, whatever the number of tasks."""
    tasks = Task.objects.all() if tasks is None else tasks
    states: dict[int, str] = dict.fromkeys(tasks.values_list("pk", flat=True), TaskState.OPEN)
    rows = WorkflowInstance.objects.filter(task__in=tasks, generation=F("task__generation"), job__isnull=False)
    last: dict[int, tuple] = {}
    active: set[int] = set()
    for task_id, state, finished_at, job_id in rows.values_list("task_id", "job__state", "job__finished_at", "job_id"):
        if state not in TERMINAL_JOB_STATES:
            active.add(task_id)
        elif task_id not in last or (finished_at, job_id) > last[task_id][:2]:
            last[task_id] = (finished_at, job_id, state)
    states.update({task_id: TaskState(state) for task_id, (_, _, state) in last.items()})
    states.update(dict.fromkeys(active, TaskState.ACTIVE))
    return states


def task_state(task: Task) -> str:
    return task_states(Task.objects.filter(pk=task.pk))[task.pk]

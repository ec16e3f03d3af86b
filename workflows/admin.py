"""Admin for tasks and workflow instances: readable, with the step history
inline, and a spawned instance's parent (the instance whose spawn step
created its task) and an instance's children. Tasks and instances are
written by sources, spawns and the queue services, so the admin edits
nothing; its actions call one service each."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from jobqueue.admin import (
    JobAdmin,
    OperateMixin,
    ReadOnlyMixin,
    cancel_one,
    cancel_results,
    each_logged,
    release_results,
    retry_one,
)
from jobqueue.clock import get_clock
from jobqueue.durations import human
from jobqueue.models import Job, JobState

from . import logs, selectors
from .models import StepRun, Task, TaskState, WorkflowInstance
from .services import affinity_key

TAIL_BYTES = 4000  # of each step's log on the instance page


def preformatted(text: str):
    """Step output as it was printed: line breaks and spacing kept, escaped."""
    return format_html('<pre class="apiary-log">{}</pre>', text) if text else "—"


class StepRunInline(ReadOnlyMixin, admin.TabularInline):
    model = StepRun
    fields = (
        "attempt_number", "step_id", "status", "worker_id", "started_at", "ended_at", "took", "exit_code", "output", "log_path",
    )  # fmt: skip
    readonly_fields = fields
    extra = 0

    @admin.display(description="took")
    def took(self, obj: StepRun) -> str:
        end = obj.ended_at or get_clock().now()
        return human((end - obj.started_at).total_seconds()) + ("" if obj.ended_at else " so far")

    @admin.display(description="output (last lines)")
    def output(self, obj: StepRun):
        """The output's tail as printed; for a skipped step, why it did not run (the journal recorded it done)."""
        return preformatted(obj.output_tail)


class InstanceInline(ReadOnlyMixin, admin.TabularInline):
    model = WorkflowInstance

    fk_name = "task"

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("job", "parent__task")

    fields = ("generation", "workflow", "state", "parent", "created_at", "finished_at")
    readonly_fields = fields

    @admin.display(description="state")
    def state(self, obj: WorkflowInstance) -> str:
        return selectors.instance_state(obj.job)

    @admin.display(description="finished at")
    def finished_at(self, obj: WorkflowInstance):
        return obj.job.finished_at if obj.job else None
    extra = 0
    show_change_link = True


class ChildInstanceInline(InstanceInline):
    """The instances whose tasks this instance's spawn steps created."""

    fk_name = "parent"
    verbose_name = "spawned instance"
    verbose_name_plural = "spawned instances"
    fields = ("task", "generation", "workflow", "state", "created_at", "finished_at")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("task")


class TaskStateFilter(admin.SimpleListFilter):
    """By the derived state (workflows.selectors.with_state): no column to filter on."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        return TaskState.choices

    def queryset(self, request, queryset):
        return queryset.filter(state=self.value()) if self.value() else queryset


@admin.register(Task)
class TaskAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "source", "item_key", "generation", "title", "state", "updated_at")
    list_filter = ("source", TaskStateFilter)
    search_fields = ("item_key", "title")
    inlines = (InstanceInline,)
    actions = ("release_affinity",)

    @admin.action(description="Release affinity of selected tasks", permissions=("operate",))
    def release_affinity(self, request, queryset):
        tasks = {affinity_key(task.pk): [task] for task in queryset}
        release_results(request, self, list(tasks), tasks)

    def get_queryset(self, request):
        return selectors.with_state(super().get_queryset(request))

    @admin.display(description="state", ordering="state")
    def state(self, obj: Task) -> str:
        return obj.state


@admin.register(WorkflowInstance)
class WorkflowInstanceAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "workflow", "task", "title", "generation", "state", "parent", "created_at", "finished_at")
    list_filter = ("job__state", "workflow")
    search_fields = ("workflow", "task__item_key", "task__title")
    list_select_related = ("task", "job", "parent__task")
    inlines = (StepRunInline, ChildInstanceInline)
    actions = ("cancel_instances", "retry_instances")
    readonly_fields = ("state", "reported_steps", "hooks", "log_tail")
    operations = {"cancel": "Cancel", "retry": "Retry"}

    @admin.display(description="title", ordering="task__title")
    def title(self, obj: WorkflowInstance) -> str:
        return obj.task.title

    @admin.display(description="steps its last finished attempt reported")
    def reported_steps(self, obj: WorkflowInstance):
        """The job summary's steps (all a remote worker's history the control plane has) as a table."""
        steps = selectors.summary_steps(obj.job)
        if not steps:
            return "—"
        attempt = obj.job.summary.get("attempt") if isinstance(obj.job.summary, dict) else None
        head = format_html(
            "<p>attempt {} on {}</p>", attempt or "?", obj.job.summary.get("worker_id") or "?"
        )  # fmt: skip
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (st["id"] or "?", st["status"] or "?", "" if st["exit_code"] is None else st["exit_code"],
                 human(st["duration"]) if isinstance(st["duration"], int | float) else "",
                 preformatted(st["error"] or st["output_tail"] or (f"reused: {st['reused']}" if st["reused"] else "")))
                for st in steps
            ),
        )  # fmt: skip
        return format_html(
            "{}<table><thead><tr><th>step</th><th>status</th><th>exit</th><th>took</th><th>output (last lines)</th>"
            "</tr></thead><tbody>{}</tbody></table>",
            head, rows,
        )  # fmt: skip

    @admin.display(description="hooks")
    def hooks(self, obj: WorkflowInstance):
        """The instance's hook jobs (enqueued as it ended) and how each ended: a hook's failure is
        shown here and never changes the instance's own state."""
        jobs = selectors.hook_jobs_of(obj)
        if not jobs:
            return "—"
        return format_html_join(
            mark_safe("<br>"),  # a constant
            '<a href="{}">job {}</a>: on {} hook, {}{}',
            (
                (reverse("admin:queue_job_change", args=[j.pk]), j.pk, j.payload["hook"].get("outcome"), j.state,
                 f" ({j.reason})" if j.reason else "")
                for j in jobs
            ),
        )  # fmt: skip

    @admin.display(description="log tail")
    def log_tail(self, obj: WorkflowInstance):
        """The last lines each step of the latest attempt streamed to the control plane (from any
        worker), preformatted; `apiary logs INSTANCE -f` follows them."""
        if not obj.pk:
            return "—"
        steps = [s for s in logs.instance_logs(instance_id=obj.pk)["steps"] if s["hook"] is None]
        latest = max((s["attempt_number"] for s in steps), default=None)
        steps = [s for s in steps if s["attempt_number"] == latest]
        if not steps:
            return "—"
        return format_html_join(
            mark_safe(""),  # a constant
            '<p><strong>{}</strong> (attempt {}, worker {}, {})</p><pre style="white-space: pre-wrap; '
            'max-height: 24em; overflow: auto">{}</pre>',
            (
                (s["step"], s["attempt_number"], s["worker_id"] or "—",
                 "running" if not s["ended"] and s["attempt_state"] == "active" else "ended",
                 logs.tail(job_id=s["job_id"], attempt_number=s["attempt_number"], step=s["step"],
                           received=s["received"], dropped=s["dropped"], size=TAIL_BYTES) or format_html("<em>{}</em>", "no output"))
                for s in steps
            ),
        )  # fmt: skip

    def available(self, obj: WorkflowInstance) -> list[str]:
        job = obj.job
        if job is None:
            return []
        ops = []
        if not job.terminal and job.cancel_requested_at is None:
            ops.append("cancel")
        if job.state in (JobState.FAILED, JobState.CANCELLED):
            ops.append("retry")
        return ops

    def perform(self, request, obj: WorkflowInstance, name: str) -> str:
        message = (cancel_one if name == "cancel" else retry_one)(request, obj.job)
        return f"instance {obj.pk}: {message}"

    def _rows(self, queryset):
        return [(i, i.job) for i in queryset.select_related("job").order_by("job_id") if i.job]

    @admin.action(description="Cancel selected instances", permissions=("operate",))
    def cancel_instances(self, request, queryset):
        cancel_results(request, self, self._rows(queryset))

    @admin.action(description="Retry selected instances (failed or cancelled: a new attempt)", permissions=("operate",))
    def retry_instances(self, request, queryset):
        each_logged(request, self, self._rows(queryset), retry_one)

    @admin.display(description="state", ordering="job__state")
    def state(self, obj: WorkflowInstance) -> str:
        return selectors.instance_state(obj.job)

    @admin.display(description="finished at", ordering="job__finished_at")
    def finished_at(self, obj: WorkflowInstance):
        return obj.job.finished_at if obj.job else None


# The queue's job list, with what a workflow job's payload names: its task's title (searchable)
# and its instance. The queue reads no payload; this layer wrote it, so it reads it here.
admin.site.unregister(Job)


@admin.register(Job)
class WorkflowJobAdmin(JobAdmin):
    list_display = ("id", "title", "instance", *JobAdmin.list_display[1:])
    search_fields = ("key", "payload__task__title")

    @admin.display(description="task title")
    def title(self, job: Job) -> str:
        task = job.payload.get("task") if isinstance(job.payload, dict) else None
        title = task.get("title") if isinstance(task, dict) else None
        hook = job.payload.get("hook") if isinstance(job.payload, dict) else None
        if isinstance(hook, dict):
            return f"{title or ''} (on {hook.get('outcome')} hook)"
        return title or "—"

    @admin.display(description="instance")
    def instance(self, job: Job):
        instance_id = job.payload.get("instance_id") if isinstance(job.payload, dict) else None
        if not isinstance(instance_id, int):
            return "—"
        url = reverse("admin:workflows_workflowinstance_change", args=[instance_id])
        return format_html('<a href="{}">{}</a>', url, instance_id)

"""Admin for tasks and workflow instances: readable, with the step history
inline, and a spawned instance's parent (the instance whose spawn step
created its task) and an instance's children. Tasks and instances are
written by sources, spawns and the queue services, so the admin edits
nothing; its actions call one service each."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from jobqueue import services
from jobqueue.admin import OperateMixin, ReadOnlyMixin, cancel_results, release_results
from jobqueue.models import Job

from . import logs, selectors
from .models import StepRun, Task, TaskState, WorkflowInstance
from .services import affinity_key

TAIL_BYTES = 4000  # of each step's log on the instance page


class StepRunInline(ReadOnlyMixin, admin.TabularInline):
    model = StepRun
    fields = ("attempt_number", "step_id", "status", "note", "worker_id", "started_at", "ended_at", "exit_code", "log_path")
    readonly_fields = fields
    extra = 0

    @admin.display(description="note")
    def note(self, obj: StepRun) -> str:
        """Why a skipped step did not run (the journal recorded it done); its tail says so."""
        return obj.output_tail if obj.status == "skipped" else ""


class InstanceInline(ReadOnlyMixin, admin.TabularInline):
    model = WorkflowInstance

    fk_name = "task"

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("job", "parent__task")

    fields = ("generation", "workflow", "state", "parent", "created_at", "finished_at")
    readonly_fields = fields

    @admin.display(description="state")
    def state(self, obj: WorkflowInstance) -> str:
        return obj.job.state if obj.job else "—"

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
        release_results(request, self, [affinity_key(pk) for pk in queryset.values_list("id", flat=True)])

    def get_queryset(self, request):
        return selectors.with_state(super().get_queryset(request))

    @admin.display(description="state", ordering="state")
    def state(self, obj: Task) -> str:
        return obj.state


@admin.register(WorkflowInstance)
class WorkflowInstanceAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "workflow", "task", "generation", "state", "parent", "created_at", "finished_at")
    list_filter = ("job__state", "workflow")
    search_fields = ("workflow", "task__item_key")
    list_select_related = ("task", "job", "parent__task")
    inlines = (StepRunInline, ChildInstanceInline)
    actions = ("cancel_instances",)
    readonly_fields = ("hooks", "log_tail")

    @admin.display(description="hooks")
    def hooks(self, obj: WorkflowInstance):
        """The instance's hook jobs (enqueued as it ended) and how each ended: a hook's failure is
        shown here and never changes the instance's own state."""
        jobs = Job.objects.filter(payload__instance_id=obj.pk, payload__has_key="hook").order_by("pk")
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

    @admin.action(description="Cancel selected instances", permissions=("operate",))
    def cancel_instances(self, request, queryset):
        jobs = [instance.job for instance in queryset.select_related("job").order_by("job_id") if instance.job]
        cancel_results(request, self, jobs, lambda job: services.job_cancel(job_id=job.pk))

    @admin.display(description="state", ordering="job__state")
    def state(self, obj: WorkflowInstance) -> str:
        return obj.job.state if obj.job else "—"

    @admin.display(description="finished at", ordering="job__finished_at")
    def finished_at(self, obj: WorkflowInstance):
        return obj.job.finished_at if obj.job else None

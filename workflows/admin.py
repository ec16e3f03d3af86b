"""Admin for tasks and workflow instances: readable, with the step history
inline. Tasks and instances are written by sources and the queue services,
so the admin edits nothing; its actions call one service each."""

from django.contrib import admin

from jobqueue import services
from jobqueue.admin import OperateMixin, ReadOnlyMixin, cancel_results, release_results
from jobqueue.models import Job

from .models import StepRun, Task, WorkflowInstance


class StepRunInline(ReadOnlyMixin, admin.TabularInline):
    model = StepRun
    fields = ("attempt_number", "step_id", "status", "worker_id", "started_at", "ended_at", "exit_code", "log_path")
    readonly_fields = fields
    extra = 0


class InstanceInline(ReadOnlyMixin, admin.TabularInline):
    model = WorkflowInstance
    fields = ("generation", "workflow", "state", "created_at", "finished_at")
    readonly_fields = fields
    extra = 0
    show_change_link = True


@admin.register(Task)
class TaskAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "source", "item_key", "generation", "title", "state", "updated_at")
    list_filter = ("source", "state")
    search_fields = ("item_key", "title")
    inlines = (InstanceInline,)
    actions = ("release_affinity",)

    @admin.action(description="Release affinity of selected tasks", permissions=("operate",))
    def release_affinity(self, request, queryset):
        release_results(request, self, queryset.values_list("id", flat=True))


@admin.register(WorkflowInstance)
class WorkflowInstanceAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "workflow", "task", "generation", "state", "created_at", "finished_at")
    list_filter = ("state", "workflow")
    search_fields = ("workflow", "task__item_key")
    list_select_related = ("task",)
    inlines = (StepRunInline,)
    actions = ("cancel_instances",)

    @admin.action(description="Cancel selected instances", permissions=("operate",))
    def cancel_instances(self, request, queryset):
        jobs = Job.objects.filter(instance__in=queryset).order_by("id")
        cancel_results(request, self, jobs, lambda job: services.instance_cancel(instance_id=job.instance_id))

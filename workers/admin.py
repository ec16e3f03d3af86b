"""Admin for workers: read-only rows with computed health; drain and undrain
actions that each call one service (the worker learns on its next heartbeat)."""

from django.contrib import admin, messages

from jobqueue import services
from jobqueue.admin import OperateMixin, ReadOnlyMixin
from jobqueue.clock import get_clock
from jobqueue.exceptions import QueueError

from .models import Worker
from .selectors import worker_health, workers_with_active_jobs


@admin.register(Worker)
class WorkerAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = (
        "worker_id",
        "pool",
        "health",
        "capacity",
        "active_jobs",
        "draining",
        "drain_requested",
        "ready",
        "last_heartbeat_at",
        "embedded",
    )
    list_filter = ("pool", "draining", "drain_requested", "ready", "embedded")
    search_fields = ("worker_id", "hostname")
    # The session identifies the worker's live process on every protocol call: not for screens.
    exclude = ("session",)
    readonly_fields = ("health", "active_jobs")
    actions = ("drain", "undrain")

    def get_queryset(self, request):
        return workers_with_active_jobs(now=get_clock().now())

    @admin.display(description="health")
    def health(self, obj: Worker) -> str:
        return worker_health(obj, now=get_clock().now())

    @admin.display(description="active jobs", ordering="live_attempts")
    def active_jobs(self, obj: Worker) -> int:
        return obj.live_attempts

    def _each(self, request, queryset, call, verb: str) -> None:
        done = []
        for worker in queryset:
            try:
                call(worker_id=worker.worker_id)
            except QueueError as exc:
                self.message_user(request, f"worker {worker.worker_id}: {exc.message}", messages.ERROR)
                continue
            done.append(worker.worker_id)
        if done:
            self.message_user(request, f"{verb}: {', '.join(done)}", messages.SUCCESS)

    @admin.action(description="Drain selected workers (stop claiming, finish, exit)", permissions=("operate",))
    def drain(self, request, queryset):
        self._each(request, queryset, services.worker_drain, "drain requested")

    @admin.action(description="Undrain selected workers", permissions=("operate",))
    def undrain(self, request, queryset):
        self._each(request, queryset, services.worker_undrain, "drain request withdrawn")

"""Admin for queue rows: read-only views, actions that call one service each.

Queue rows change only through jobqueue.services, so nobody may add, edit or
delete them here. The actions (cancel, release affinity) need the model's
`change` permission: Django's permission says who may operate the queue,
while `has_change_permission` stays False so no form ever edits a row.
"""

from django.contrib import admin, messages

from . import services
from .clock import get_clock
from .exceptions import QueueError
from .models import Affinity, Attempt, Job, JobEvent, JobState, RequirementSet, Worker, WorkerCredential
from .selectors import worker_health, workers_with_active_jobs


class ReadOnlyMixin:
    """View only: no add, change or delete, in model admins and inlines alike."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class OperateMixin:
    """`allowed_permissions = ("operate",)` on an action: the user holds the
    model's change permission (the only thing it is used for)."""

    def has_operate_permission(self, request):
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")


class AttemptInline(ReadOnlyMixin, admin.TabularInline):
    model = Attempt
    fk_name = "job"
    # token_hash is deliberately absent: not even its digest belongs on a screen.
    fields = (
        "number",
        "state",
        "worker",
        "claimed_at",
        "lease_expires_at",
        "last_heartbeat_at",
        "finished_at",
        "job_state",
        "error",
    )
    readonly_fields = fields
    extra = 0
    ordering = ("number",)
    show_change_link = False


class JobEventInline(ReadOnlyMixin, admin.TabularInline):
    model = JobEvent
    fields = ("at", "kind", "worker_id", "attempt", "detail")
    readonly_fields = fields
    extra = 0


def cancel_results(request, modeladmin, jobs, call) -> None:
    """Run `call(job)` (one service call) per job and tell the user what happened."""
    done: dict[str, list[str]] = {"cancelled": [], "cancel requested": [], "already finished": []}
    for job in jobs:
        before = job.state
        try:
            after = call(job)
        except QueueError as exc:
            modeladmin.message_user(request, f"job {job.pk}: {exc.message}", messages.ERROR)
            continue
        if before in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
            done["already finished"].append(str(job.pk))
        elif after.state == JobState.CANCELLED:
            done["cancelled"].append(str(job.pk))
        else:
            done["cancel requested"].append(str(job.pk))
    for what, ids in done.items():
        if ids:
            modeladmin.message_user(request, f"{what}: job {', '.join(ids)}", messages.SUCCESS)


def release_results(request, modeladmin, keys) -> None:
    """Release each affinity key (one service call each) and say which were pinned."""
    released, unpinned = [], []
    for key in sorted(set(k for k in keys if k)):
        (released if services.affinity_release(key=key) else unpinned).append(key)
    if released:
        modeladmin.message_user(request, f"affinity released: {', '.join(released)}", messages.SUCCESS)
    if unpinned:
        modeladmin.message_user(request, f"not pinned: {', '.join(unpinned)}", messages.INFO)


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "key", "state", "agent", "runner", "pool", "attempt_count", "created_at")
    list_filter = ("state", "pool", "agent", "runner")
    search_fields = ("key",)
    ordering = ("-id",)
    inlines = (AttemptInline, JobEventInline)
    actions = ("cancel_jobs", "release_affinity")
    list_per_page = 100
    show_full_result_count = False  # a COUNT(*) over a deep queue on every page load buys nothing

    @admin.action(description="Cancel selected jobs", permissions=("operate",))
    def cancel_jobs(self, request, queryset):
        cancel_results(request, self, queryset, lambda job: services.job_cancel(job_id=job.pk))

    @admin.action(description="Release affinity of the selected jobs", permissions=("operate",))
    def release_affinity(self, request, queryset):
        rows = list(queryset.values_list("pk", "affinity_key"))
        unpinnable = [str(pk) for pk, key in rows if key is None]
        if unpinnable:
            self.message_user(request, f"not affinity jobs: job {', '.join(unpinnable)}", messages.INFO)
        release_results(request, self, [key for _, key in rows if key is not None])


@admin.register(Affinity)
class AffinityAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("key", "worker_id", "pinned_at")
    list_filter = ("worker_id",)
    search_fields = ("worker_id", "key")
    actions = ("release",)

    @admin.action(description="Release selected pins", permissions=("operate",))
    def release(self, request, queryset):
        release_results(request, self, queryset.values_list("key", flat=True))


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "job", "kind", "at", "worker_id", "attempt")
    list_filter = ("kind",)
    search_fields = ("job__key", "worker_id")
    list_select_related = ("job", "attempt")
    show_full_result_count = False


@admin.register(RequirementSet)
class RequirementSetAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "pool", "labels", "capabilities")
    exclude = ("digest",)


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
    actions = ("drain", "undrain", "revoke_credentials")

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

    @admin.action(
        description="Revoke selected workers' credentials (their jobs go back to the queue)", permissions=("operate",)
    )
    def revoke_credentials(self, request, queryset):
        self._each(request, queryset, services.credentials_revoke, "credentials revoked")


@admin.register(WorkerCredential)
class WorkerCredentialAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    """Per-worker credentials: who holds one, since when, revoked or not. Only
    a digest is stored; `apiary worker token create ID` issues a new one."""

    list_display = ("worker_id", "hint", "issued_by", "created_at", "last_used_at", "revoked_at")
    list_filter = ("issued_by", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("worker_id",)
    exclude = ("digest",)
    actions = ("revoke",)

    @admin.action(description="Revoke every credential of the selected workers", permissions=("operate",))
    def revoke(self, request, queryset):
        revoked = []
        for worker_id in sorted(set(queryset.filter(revoked_at__isnull=True).values_list("worker_id", flat=True))):
            try:
                services.credentials_revoke(worker_id=worker_id)
            except QueueError as exc:
                self.message_user(request, f"worker {worker_id}: {exc.message}", messages.ERROR)
                continue
            revoked.append(worker_id)
        if revoked:
            self.message_user(request, f"credentials revoked: {', '.join(revoked)}", messages.SUCCESS)

"""Admin for queue rows: read-only views, actions that call one service each.

Queue rows change only through jobqueue.services, so nobody may add, edit or
delete them here. The actions (cancel, retry, drain, release affinity, forget)
need the model's `change` permission: Django's permission says who may operate
the queue, while `has_change_permission` stays False so no form ever edits a row.
Each action and detail-page button is one service call per row, names the
admin user as its actor in the row's events, and is kept in Django's LogEntry
(the object's History page).
"""

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, Subquery
from django.http import Http404, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.urls import path, reverse
from django.utils import formats
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from . import services
from .clock import get_clock
from .durations import ago, human
from .exceptions import QueueError
from .models import (
    Affinity,
    Attempt,
    AttemptState,
    Job,
    JobEvent,
    JobState,
    RequirementSet,
    Worker,
    WorkerCredential,
    WorkerEvent,
)
from .selectors import HEALTHY, worker_health, worker_is_draining, workers_with_active_jobs
from .selectors.dashboard import blocked_by_job


def actor(request) -> str:
    """Who an admin action acts for, in the events it writes: the admin user's name."""
    return request.user.get_username()


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
    model's change permission (the only thing it is used for).

    Detail-page buttons: `operations` names them ({name: label}); `available(obj)`
    says which apply to a row now; `perform(request, obj, name)` is the one service
    call and returns what to tell the user. Each button is a POST form (CSRF) to
    `<pk>/operate/<name>/`, refused without the permission, logged in LogEntry."""

    operations: dict[str, str] = {}
    change_form_template = "admin/apiary_operate_change_form.html"

    def has_operate_permission(self, request):
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def available(self, obj) -> list[str]:
        return []

    def perform(self, request, obj, name: str) -> str:
        raise NotImplementedError

    def get_urls(self):
        name = f"{self.opts.app_label}_{self.opts.model_name}_operate"
        view = self.admin_site.admin_view(self.operate_view)
        return [path("<path:object_id>/operate/<str:operation>/", view, name=name), *super().get_urls()]

    def operate_view(self, request, object_id, operation):
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_operate_permission(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None or operation not in self.operations:
            raise Http404(f"no {self.opts.verbose_name} {object_id} or no operation {operation!r}")
        if operation not in self.available(obj):  # a stale page's button: say so, change nothing
            self.message_user(request, f"{self.operations[operation]} does not apply to {obj} now", messages.WARNING)
            return redirect(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[obj.pk]))
        try:
            message = self.perform(request, obj, operation)
        except QueueError as exc:
            self.message_user(request, exc.message, messages.ERROR)
        else:
            self.log_change(request, obj, message)
            self.message_user(request, message, messages.SUCCESS)
        return redirect(reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[obj.pk]))

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        if obj is not None and self.has_operate_permission(request):
            name = f"admin:{self.opts.app_label}_{self.opts.model_name}_operate"
            context["operations"] = [
                {"name": op, "label": self.operations[op], "url": reverse(name, args=[obj.pk, op])}
                for op in self.available(obj)
            ]
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)


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
    fields = ("at", "kind", "actor", "worker_id", "attempt", "detail")
    readonly_fields = fields
    extra = 0

    @admin.display(description="actor")
    def actor(self, obj: JobEvent) -> str:
        return obj.detail.get("actor", "") if isinstance(obj.detail, dict) else ""


def cancel_one(request, job: Job) -> str:
    """Cancel one job (one service call) for the admin user; what happened, in words."""
    before = job.state
    after = services.job_cancel(job_id=job.pk, actor=actor(request))
    if before in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        return f"job {job.pk} already {before}; nothing to cancel"
    if after.state == JobState.CANCELLED:
        return f"job {job.pk} cancelled"
    return f"job {job.pk}: cancel requested; its worker stops it at its next heartbeat"


def retry_one(request, job: Job) -> str:
    before = job.state
    after = services.job_retry(job_id=job.pk, actor=actor(request))
    return f"job {job.pk} was {before}; queued again as attempt {after.attempt_count + 1}"


def each_logged(request, modeladmin, rows, call) -> None:
    """`call(request, job)` (one service call) per row: its message (or its error) to the user,
    and a LogEntry on `row` (a job, or the instance the job belongs to). `rows` are (row, job)."""
    for row, job in rows:
        try:
            message = call(request, job)
        except QueueError as exc:
            modeladmin.message_user(request, f"job {job.pk}: {exc.message}", messages.ERROR)
            continue
        modeladmin.log_change(request, row, message)
        modeladmin.message_user(request, message, messages.SUCCESS)


def cancel_results(request, modeladmin, rows) -> None:
    """Cancel each row's job (one service call each), log it on the row (a job, or its
    instance) and tell the user, grouped, what happened. `rows` are (row, job)."""
    done: dict[str, list[str]] = {"cancelled": [], "cancel requested": [], "already finished": []}
    for row, job in rows:
        before = job.state
        try:
            after = services.job_cancel(job_id=job.pk, actor=actor(request))
        except QueueError as exc:
            modeladmin.message_user(request, f"job {job.pk}: {exc.message}", messages.ERROR)
            continue
        if before in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
            what = "already finished"
        elif after.state == JobState.CANCELLED:
            what = "cancelled"
        else:
            what = "cancel requested"
        done[what].append(str(job.pk))
        if what != "already finished":
            modeladmin.log_change(request, row, f"{what}: job {job.pk}")
    for what, ids in done.items():
        if ids:
            modeladmin.message_user(request, f"{what}: job {', '.join(ids)}", messages.SUCCESS)


def release_results(request, modeladmin, keys, rows=None) -> None:
    """Release each affinity key (one service call each) and say which were pinned; a release
    is logged (LogEntry) on the selected rows that named its key (`rows`: {key: [row, …]})."""
    released, unpinned = [], []
    for key in sorted(set(k for k in keys if k)):
        if services.affinity_release(key=key, actor=actor(request)):
            released.append(key)
            for row in (rows or {}).get(key, ()):
                modeladmin.log_change(request, row, f"affinity released: {key}")
        else:
            unpinned.append(key)
    if released:
        modeladmin.message_user(request, f"affinity released: {', '.join(released)}", messages.SUCCESS)
    if unpinned:
        modeladmin.message_user(request, f"not pinned: {', '.join(unpinned)}", messages.INFO)


def _blocked(request) -> dict[int, str]:
    """Why each blocked queued job waits, judged once per request (the column and the filter share it)."""
    if not hasattr(request, "_apiary_blocked"):
        request._apiary_blocked = blocked_by_job(now=get_clock().now())
    return request._apiary_blocked


class WaitingFilter(admin.SimpleListFilter):
    """A real block (no registered worker can take it now: blocked_reasons) or ordinary backlog."""

    title = "waiting"
    parameter_name = "waiting"

    def lookups(self, request, model_admin):
        return (("blocked", "blocked (no worker can take it now)"), ("backlog", "backlog (waiting its turn)"))

    def queryset(self, request, queryset):
        if self.value() == "blocked":
            return queryset.filter(pk__in=list(_blocked(request)))
        if self.value() == "backlog":
            return queryset.filter(state=JobState.QUEUED).exclude(pk__in=list(_blocked(request)))
        return queryset


def job_elapsed(job: Job, now) -> str:
    """Running for (leased), waiting for (queued), or how long its last attempt took (finished)."""
    attempt = job.current_attempt
    if job.state == JobState.LEASED and attempt is not None:
        return f"running {human((now - attempt.claimed_at).total_seconds())}"
    if job.state == JobState.QUEUED:
        if job.available_at > now:
            return f"retry {ago(job.available_at, now)}"
        return f"waiting {human((now - job.available_at).total_seconds())}"
    if attempt is not None and job.finished_at is not None:
        return f"took {human((job.finished_at - attempt.claimed_at).total_seconds())}"
    return "—"


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("id", "key", "state", "worker", "elapsed", "why", "agent", "pool", "attempt_count", "created_at")
    list_filter = ("state", WaitingFilter, "pool", "agent", "runner")
    search_fields = ("key",)
    ordering = ("-id",)
    inlines = (AttemptInline, JobEventInline)
    actions = ("cancel_jobs", "retry_jobs", "release_affinity")
    list_select_related = ("current_attempt",)
    list_per_page = 100
    show_full_result_count = False  # a COUNT(*) over a deep queue on every page load buys nothing
    operations = {"cancel": "Cancel", "retry": "Retry", "release": "Release affinity"}

    def get_queryset(self, request):
        # The last error any attempt reported, in the same query (a job queued again after a
        # failure has no current attempt to read it from).
        last_error = Attempt.objects.filter(job=OuterRef("pk")).exclude(error="").order_by("-number").values("error")[:1]
        return super().get_queryset(request).annotate(last_error=Subquery(last_error))

    def get_list_display(self, request):
        """`why` and `elapsed` are read once per page (the blocked judgement, the clock), not per row."""
        now = get_clock().now()
        blocked = lambda: _blocked(request)  # noqa: E731 - judged only when a queued job is shown

        @admin.display(description="elapsed")
        def elapsed(job: Job) -> str:
            return job_elapsed(job, now)

        @admin.display(description="why")
        def why(job: Job) -> str:
            """Why a queued job waits (a real block), or why a finished one ended; the last error otherwise."""
            if job.state == JobState.QUEUED:
                reason = blocked().get(job.pk)
                return format_html('<span class="apiary-blocked">blocked: {}</span>', reason) if reason else "backlog"
            return job.reason or getattr(job, "last_error", None) or ""

        columns = {"why": why, "elapsed": elapsed}
        return tuple(columns.get(name, name) for name in self.list_display)

    # What list_display names; get_list_display puts per-page versions in their place.
    @admin.display(description="why")
    def why(self, job: Job) -> str:
        return job.reason

    @admin.display(description="elapsed")
    def elapsed(self, job: Job) -> str:
        return job_elapsed(job, get_clock().now())

    @admin.display(description="worker", ordering="current_attempt__worker_id")
    def worker(self, job: Job) -> str:
        return job.current_attempt.worker_id if job.current_attempt else "—"

    def available(self, job: Job) -> list[str]:
        ops = []
        if not job.terminal and job.cancel_requested_at is None:
            ops.append("cancel")
        if job.state in (JobState.FAILED, JobState.CANCELLED):
            ops.append("retry")
        if job.affinity_key and Affinity.objects.filter(key=job.affinity_key).exists():
            ops.append("release")
        return ops

    def perform(self, request, job: Job, name: str) -> str:
        if name == "cancel":
            return cancel_one(request, job)
        if name == "retry":
            return retry_one(request, job)
        released = services.affinity_release(key=job.affinity_key or "", actor=actor(request))
        return f"affinity {job.affinity_key} released" if released else f"{job.affinity_key} was not pinned"

    @admin.action(description="Cancel selected jobs", permissions=("operate",))
    def cancel_jobs(self, request, queryset):
        cancel_results(request, self, [(job, job) for job in queryset])

    @admin.action(description="Retry selected jobs (failed or cancelled: queued again as a new attempt)", permissions=("operate",))
    def retry_jobs(self, request, queryset):
        each_logged(request, self, [(job, job) for job in queryset], retry_one)

    @admin.action(description="Release affinity of the selected jobs", permissions=("operate",))
    def release_affinity(self, request, queryset):
        jobs = list(queryset)
        unpinnable = [str(job.pk) for job in jobs if job.affinity_key is None]
        if unpinnable:
            self.message_user(request, f"not affinity jobs: job {', '.join(unpinnable)}", messages.INFO)
        rows: dict = {}
        for job in jobs:
            if job.affinity_key is not None:
                rows.setdefault(job.affinity_key, []).append(job)
        release_results(request, self, list(rows), rows)


@admin.register(Affinity)
class AffinityAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = ("key", "worker_id", "pinned_at")
    list_filter = ("worker_id",)
    search_fields = ("worker_id", "key")
    actions = ("release",)

    @admin.action(description="Release selected pins", permissions=("operate",))
    def release(self, request, queryset):
        pins = list(queryset)
        release_results(request, self, [p.key for p in pins], {p.key: [p] for p in pins})


@admin.register(JobEvent)
class JobEventAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "job", "kind", "at", "worker_id", "attempt")
    list_filter = ("kind",)
    search_fields = ("job__key", "worker_id")
    list_select_related = ("job", "attempt")
    show_full_result_count = False


@admin.register(WorkerEvent)
class WorkerEventAdmin(ReadOnlyMixin, admin.ModelAdmin):
    """What operators did to workers, and who (detail.actor)."""

    list_display = ("id", "worker_id", "kind", "at", "actor")
    list_filter = ("kind",)
    search_fields = ("worker_id",)
    show_full_result_count = False

    @admin.display(description="actor")
    def actor(self, obj: WorkerEvent) -> str:
        return obj.detail.get("actor", "") if isinstance(obj.detail, dict) else ""


@admin.register(RequirementSet)
class RequirementSetAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "pool", "labels", "capabilities")
    exclude = ("digest",)


class ForgottenFilter(admin.SimpleListFilter):
    """Forgotten workers (services.worker_forget) are hidden unless asked for."""

    title = "forgotten"
    parameter_name = "forgotten"

    def lookups(self, request, model_admin):
        return (("yes", "forgotten"), ("all", "all"))

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(forgotten_at__isnull=False)
        if self.value() == "all":
            return queryset
        return queryset.filter(forgotten_at__isnull=True)


@admin.register(Worker)
class WorkerAdmin(ReadOnlyMixin, OperateMixin, admin.ModelAdmin):
    list_display = (
        "worker_id",
        "pool",
        "health",
        "capacity",
        "active_jobs",
        "is_draining",
        "drain_requested",
        "ready",
        "last_heartbeat",
        "embedded",
    )
    list_filter = ("pool", "draining", "drain_requested", "ready", "embedded", ForgottenFilter)
    search_fields = ("worker_id", "hostname")
    # The session identifies the worker's live process on every protocol call: not for screens.
    exclude = ("session",)
    readonly_fields = ("health", "active_jobs", "is_draining", "last_heartbeat", "events")
    actions = ("drain", "undrain", "forget", "revoke_credentials")
    operations = {"drain": "Drain", "undrain": "Undrain", "forget": "Forget"}

    def get_queryset(self, request):
        return workers_with_active_jobs(now=get_clock().now())

    @admin.display(description="health")
    def health(self, obj: Worker) -> str:
        return worker_health(obj, now=get_clock().now())

    @admin.display(description="active jobs", ordering="live_attempts")
    def active_jobs(self, obj: Worker) -> int:
        return obj.live_attempts

    @admin.display(description="draining", boolean=True)
    def is_draining(self, obj: Worker) -> bool:
        """Draining as `apiary status` and the claim see it: the worker said so or an operator asked."""
        return worker_is_draining(obj)

    @admin.display(description="last heartbeat", ordering="last_heartbeat_at")
    def last_heartbeat(self, obj: Worker) -> str:
        local = formats.localize(obj.last_heartbeat_at)
        return f"{local} ({ago(obj.last_heartbeat_at, get_clock().now())})"

    @admin.display(description="operator actions")
    def events(self, obj: Worker):
        rows = WorkerEvent.objects.filter(worker_id=obj.worker_id).order_by("-id")[:50]
        if not rows:
            return "—"
        return format_html_join(
            mark_safe("<br>"),  # a constant
            "{} {} {}",
            ((formats.localize(e.at), e.kind, e.detail.get("actor", "")) for e in rows),
        )

    def available(self, obj: Worker) -> list[str]:
        ops = ["undrain" if obj.drain_requested else "drain"]
        gone = worker_health(obj, now=get_clock().now()) != HEALTHY and not obj.forgotten_at
        if gone and not Attempt.objects.filter(worker_id=obj.worker_id, state=AttemptState.ACTIVE).exists():
            ops.append("forget")
        return ops

    def perform(self, request, obj: Worker, name: str) -> str:
        call = {"drain": services.worker_drain, "undrain": services.worker_undrain, "forget": services.worker_forget}[name]
        call(worker_id=obj.worker_id, actor=actor(request))
        return {"drain": "drain requested", "undrain": "drain request withdrawn", "forget": "forgotten"}[name] + (
            f": {obj.worker_id}"
        )

    def _each(self, request, queryset, call, verb: str) -> None:
        done = []
        for worker in queryset:
            try:
                call(worker_id=worker.worker_id, actor=actor(request))
            except QueueError as exc:
                self.message_user(request, f"worker {worker.worker_id}: {exc.message}", messages.ERROR)
                continue
            self.log_change(request, worker, f"{verb}: {worker.worker_id}")
            done.append(worker.worker_id)
        if done:
            self.message_user(request, f"{verb}: {', '.join(done)}", messages.SUCCESS)

    @admin.action(description="Drain selected workers (stop claiming, finish, exit)", permissions=("operate",))
    def drain(self, request, queryset):
        self._each(request, queryset, services.worker_drain, "drain requested")

    @admin.action(description="Undrain selected workers", permissions=("operate",))
    def undrain(self, request, queryset):
        self._each(request, queryset, services.worker_undrain, "drain request withdrawn")

    @admin.action(description="Forget selected workers (gone: no heartbeat or exited; holding no job)", permissions=("operate",))
    def forget(self, request, queryset):
        self._each(request, queryset, services.worker_forget, "forgotten")

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
                services.credentials_revoke(worker_id=worker_id, actor=actor(request))
            except QueueError as exc:
                self.message_user(request, f"worker {worker_id}: {exc.message}", messages.ERROR)
                continue
            revoked.append(worker_id)
        if revoked:
            self.message_user(request, f"credentials revoked: {', '.join(revoked)}", messages.SUCCESS)

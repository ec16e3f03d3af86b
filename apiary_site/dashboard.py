"""The operator's dashboard, on the admin's index page: queue facts (jobqueue.selectors.dashboard)
and workflow facts (workflows.selectors) side by side. It lives here, in the wiring layer,
because it is the one page that reads both; each fact is read by the layer that owns it.

The last hour's chart is SVG drawn here, on the server: the admin's Content-Security-Policy
allows no inline script, and a chart needs none. The page refreshes itself with a
`<meta http-equiv="refresh">`.
"""

import datetime as dt

from django.urls import reverse
from django.utils.html import format_html, format_html_join

from jobqueue.durations import ago, human
from jobqueue.selectors import dashboard as queue_facts
from workflows import selectors as workflow_facts

REFRESH_SECONDS = 10
DIMENSIONS = ("project", "pool", "agent")

# The chart: one bar per minute, stacked by outcome.
WIDTH, HEIGHT, BAR_GAP = 600, 120, 1
COLOURS = {"succeeded": "#3a7f3a", "failed": "#ba2121", "cancelled": "#999999"}


def context(*, now: dt.datetime) -> dict:
    """Everything the dashboard shows, read at `now`."""
    minutes = queue_facts.outcomes_per_minute(now=now)
    running = queue_facts.running(now=now)
    steps = workflow_facts.current_steps(r.refs["instance_id"] for r in running if isinstance(r.refs["instance_id"], int))
    oldest = queue_facts.oldest_queued(now=now)
    return {
        "refresh_seconds": REFRESH_SECONDS,
        "now": now,
        "states": queue_facts.STATES,
        "counts": {d: queue_facts.counts_by(d) for d in DIMENSIONS},
        "hour": {o: sum(m[o] for m in minutes) for o in queue_facts.OUTCOMES},
        "chart": chart(minutes),
        "oldest": oldest and {**oldest, "age_text": human(oldest["age"]), "url": _job_url(oldest["job_id"])},
        "blocked": [
            {**group, "links": [(job_id, _job_url(job_id)) for job_id in group["jobs"][:10]]}
            for group in queue_facts.blocked_by_reason(now=now)
        ],
        "running": [
            {
                "job_id": r.job_id,
                "job_url": _job_url(r.job_id),
                "instance_id": r.refs["instance_id"],
                "instance_url": _instance_url(r.refs["instance_id"]),
                "title": r.title + (f" (on {r.refs['hook']} hook)" if r.refs["hook"] else ""),
                "workflow": r.refs["workflow"] or "—",
                "worker_id": r.worker_id,
                "worker_url": reverse("admin:queue_worker_change", args=[r.worker_id]),
                "attempt": r.attempt_number,
                "step": steps.get(r.refs["instance_id"], "—"),
                "elapsed": human(r.elapsed),
                "heartbeat": ago(r.last_heartbeat_at, now),
                "cancel_requested": r.cancel_requested,
            }
            for r in running
        ],
        "gone_workers": [
            {**w, "silent_text": human(w["silent"]), "url": reverse("admin:queue_worker_change", args=[w["worker_id"]])}
            for w in queue_facts.gone_workers(now=now)
        ],
    }


def _job_url(job_id: int) -> str:
    return reverse("admin:queue_job_change", args=[job_id])


def _instance_url(instance_id) -> str | None:
    return reverse("admin:workflows_workflowinstance_change", args=[instance_id]) if isinstance(instance_id, int) else None


def chart(minutes: list[dict]) -> str:
    """An SVG bar chart of outcomes per minute (oldest left), with a title per bar for its numbers."""
    peak = max((sum(m[o] for o in queue_facts.OUTCOMES) for m in minutes), default=0) or 1
    step = WIDTH / max(len(minutes), 1)
    bars = []
    for i, minute in enumerate(minutes):
        y = HEIGHT
        label = f"{minute['minute']:%H:%M} UTC: " + ", ".join(f"{minute[o]} {o}" for o in queue_facts.OUTCOMES)
        for outcome in queue_facts.OUTCOMES:
            h = HEIGHT * minute[outcome] / peak
            if h <= 0:
                continue
            y -= h
            bars.append((round(i * step, 2), round(y, 2), round(max(step - BAR_GAP, 1), 2), round(h, 2), COLOURS[outcome], label))
    rects = format_html_join(
        "", '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>', bars
    )  # fmt: skip
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {} {}" role="img" aria-label="{}">'
        '<line x1="0" y1="{}" x2="{}" y2="{}" stroke="#ccc"/>{}</svg>',
        WIDTH, HEIGHT + 1, f"jobs finished per minute, last {len(minutes)} minutes (peak {peak})",
        HEIGHT, WIDTH, HEIGHT, rects,
    )  # fmt: skip

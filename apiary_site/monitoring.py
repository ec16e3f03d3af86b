"""`GET /metrics` and `GET /healthz`: who may scrape, what each answers, and
the Django views the listener serves them with (the daemon's own address,
settings.metrics.listen, serves the same answers: apiary_site.monitorserver).

Scraping does not take the worker token (whoever holds that can act as a
worker). With `settings.metrics.token` set, /metrics wants
`Authorization: Bearer <that token>` from anyone; without it, /metrics
answers loopback clients only, and none behind the TLS proxy of
settings.queue.tls (through a proxy on this machine every client looks
local). /healthz answers anyone: it tells only whether the database answers
and the reaper runs, what a load balancer or an orchestrator probe needs
without a secret.
"""

import datetime as dt
import hmac
import ipaddress
import json
import logging
import shutil
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.exposition import choose_encoder

from jobqueue import conf
from jobqueue import metrics as queue_metrics
from jobqueue.clock import get_clock
from workers import private
from workflows import reaperbeat
from workflows.config import MetricsSettings

log = logging.getLogger("apiary.monitoring")

REAPER_GRACE = 30.0  # seconds: the reaper runs every second; less than this late is a busy loop, not a stopped one
METRICS_DIR = "metrics"  # under the state directory: the processes' metric files (jobqueue.metrics)


def reset_metrics_dir(state_dir: Path) -> Path:
    """An empty directory for this run's metric files: `apiary run` makes it at
    start (it holds the state lock, so no other run writes there), as
    prometheus-client's multiprocess mode requires — files of an earlier run
    would be added to this one's."""
    directory = state_dir / METRICS_DIR
    shutil.rmtree(directory, ignore_errors=True)
    return private.private_dir(directory)


def _loopback(peer: str | None) -> bool:
    try:
        address = ipaddress.ip_address((peer or "").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def refusal(authorization: str | None, peer: str | None, *, behind_proxy: bool) -> tuple[int, str] | None:
    """Why this scrape is refused, as (status, message); None when it may scrape."""
    metrics: MetricsSettings = getattr(settings, "APIARY_METRICS", MetricsSettings())
    if metrics.token:
        given = _bearer(authorization)
        if given is None:
            return 401, "this endpoint needs Authorization: Bearer <settings.metrics.token>\n"
        if not hmac.compare_digest(given.encode(), metrics.token.encode()):
            return 401, "the bearer token is not settings.metrics.token\n"
        return None
    if behind_proxy:
        return 403, "behind the proxy of settings.queue.tls every client looks local: set settings.metrics.token to scrape\n"
    if not _loopback(peer):
        return 403, "without settings.metrics.token only loopback clients may scrape\n"
    return None


def metrics_answer(
    authorization: str | None, peer: str | None, *, behind_proxy: bool, accept: str | None = None
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a scrape, in the format its Accept header asks for (Prometheus text by default)."""
    refused = refusal(authorization, peer, behind_proxy=behind_proxy)
    if refused is not None:
        status, message = refused
        headers = {"Content-Type": "text/plain; charset=utf-8"}
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="apiary-metrics"'
        return status, headers, message.encode()
    encode, content_type = choose_encoder(accept or "")
    try:
        body = encode(queue_metrics.registry())
    except DatabaseError as exc:
        log.warning("/metrics: the database did not answer: %s", exc)
        return 503, {"Content-Type": "text/plain; charset=utf-8"}, b"the database did not answer\n"
    return 200, {"Content-Type": content_type}, body


def health() -> tuple[int, dict]:
    """(200 or 503, the JSON body): the database answers a query, and the
    reaper has run within max(lease_duration, REAPER_GRACE) — past that,
    leases that ran out are not being given back."""
    problems = []
    body: dict = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        body["database"] = "ok"
    except DatabaseError as exc:
        log.warning("/healthz: the database did not answer: %s", exc)
        body["database"] = "unreachable"
        problems.append("database: did not answer")  # its error (host names, paths) goes to the log only
    limit = max(conf.current().lease_duration, REAPER_GRACE)
    state_dir = getattr(settings, "APIARY_STATE", None)
    beat = reaperbeat.last(Path(state_dir)) if state_dir else None
    if beat is None:
        body["reaper"] = {"last_run": None}
        problems.append("reaper: no run recorded (is `apiary run` running?)")
    else:
        ago = max(0.0, (get_clock().now() - beat).total_seconds())
        body["reaper"] = {"last_run": beat.astimezone(dt.UTC).isoformat().replace("+00:00", "Z"), "seconds_ago": round(ago, 3)}
        if ago > limit:
            problems.append(f"reaper: last ran {ago:.0f}s ago (more than {limit:g}s)")
    if problems:
        return 503, {"status": "unavailable", "problems": problems, **body}
    return 200, {"status": "ok", **body}


def _response(status: int, headers: dict, body: bytes) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type=headers.pop("Content-Type"))
    for name, value in headers.items():
        response[name] = value
    response["Cache-Control"] = "no-store"
    return response


@require_safe
def metrics_view(request):
    behind_proxy = bool(settings.SECURE_PROXY_SSL_HEADER)  # settings.queue.tls: apiary_site.security
    meta = request.META
    answer = metrics_answer(
        meta.get("HTTP_AUTHORIZATION"), meta.get("REMOTE_ADDR"), behind_proxy=behind_proxy, accept=meta.get("HTTP_ACCEPT")
    )
    return _response(*answer)


@require_safe
def healthz_view(request):
    status, body = health()
    return _response(status, {"Content-Type": "application/json"}, json.dumps(body).encode())

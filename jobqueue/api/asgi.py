"""The worker protocol under ASGI: served here, in front of Django's handler.

Django's ASGI handler runs every request's sync parts (middleware, signals,
a sync view) in a thread of its own that stays parked until the request
ends, and reads the whole body — any size, spooled to disk — before anything
checks the token. For the worker protocol both are wrong: a long-poll would
park a thread per waiting worker, and an anonymous client could make us
store a body of any size. So requests under /api/worker/ are answered here:

* the token is checked before the body is read (a per-worker credential's
  lookup in the thread pool), and the body is read at
  most one byte past the protocol's limit (the view then answers 413; a
  declared Content-Length over it is answered without reading anything);
* the DRF views run unchanged — the same validation, answers and errors as
  under WSGI — heartbeats, finishes and the rest in a pool of threads that
  never wait on anything but the database (`API_THREADS`);
* `POST claims` is validated by its view on the event loop (CPU only), which
  hands back the arguments instead of claiming, and the long-poll runs as a
  coroutine (`claim_with_wait_async`): while it waits it holds no thread, no
  connection and runs no query. A client that hangs up ends the wait; a
  claim round already running finishes and gives back what it leased. A
  claim over its worker's budget (api/throttle.py) is answered 429 only
  after its Retry-After has passed.

Everything else (the admin) goes to Django unchanged.
"""

import asyncio
import contextlib
import io
from concurrent.futures import ThreadPoolExecutor

from django.core.exceptions import DisallowedHost
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections
from django.http import HttpResponse
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import resolve
from django.utils.log import log_response
from rest_framework import exceptions as drf
from rest_framework.renderers import JSONRenderer

from jobqueue import longpoll
from jobqueue.types import CREDENTIAL_PREFIX as PREFIX_OF_CREDENTIALS

from . import serializers as s
from .auth import PRINCIPAL, WorkerPrincipal, bearer_of, principal_of
from .errors import classify, error_body
from .parsers import body_limit
from .views import DEFER_CLAIM, PROTOCOL_VERSION, Deferred

PREFIX = "/api/worker"
CREDENTIAL_PREFIX = PREFIX_OF_CREDENTIALS.encode()
CLAIMS = "/api/worker/v1/claims"
API_THREADS = 16  # protocol calls other than waiting claims in flight at once, per process

_api_pool = ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="apiary-api")
_release = close_old_connections  # after each call (tests keep their one connection open instead)
_hold = asyncio.sleep  # how a refused claim waits (tests record it instead)
MAX_HOLD = 5.0  # seconds: well inside a worker's read timeout, whatever claim_rate is


def with_worker_protocol(django: ASGIHandler):
    """An ASGI application: the worker protocol here, everything else to `django`."""

    def finish(request, response):  # what Django's handler and response middleware would have done
        response = CommonMiddleware(lambda r: response).process_response(request, response)
        response = SecurityMiddleware(lambda r: response).process_response(request, response)
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request)
        return response

    async def application(scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            await _serve(django, finish, scope, receive, send)
        else:
            await django(scope, receive, send)

    return application


async def _serve(django: ASGIHandler, finish, scope, receive, send) -> None:
    request, error = django.create_request(scope, io.BytesIO())
    if request is None:
        await django.send_response(_refused(error.status_code), send)
        return
    try:
        request.get_host()  # ALLOWED_HOSTS, as Django's CommonMiddleware checks it
    except DisallowedHost:
        await django.send_response(_json(error_body("invalid_request", "the Host header is not allowed"), 400), send)
        return
    try:
        principal = await _principal(request)
    except Exception as exc:  # noqa: BLE001 - the credential's lookup failed (a database down): answered as the views do
        status, code, message, details, headers = classify(exc)
        await django.send_response(_json(error_body(code, message, details), status, headers), send)
        return
    authenticated = isinstance(principal, WorkerPrincipal)
    if authenticated and not _declared_too_large(request):  # the view answers both without a body
        body = await _read_capped(receive)
        if body is None:
            return  # the client hung up
        request, error = django.create_request(scope, body)
        if request is None:
            await django.send_response(_refused(error.status_code), send)
            return
    request.META[PRINCIPAL] = principal  # the view's authentication takes it: no second lookup
    if scope["method"] == "POST" and scope["path"] == CLAIMS:
        request.META[DEFER_CLAIM] = True
        if authenticated and principal.worker_id is None:
            # The shared token: whether it may still act for this id is a query (services/identity.py).
            response = await longpoll.offload(_api_pool, _call_view, request)
        else:
            response = _call_view(request, close=False)  # validation only: no query on the loop
        if isinstance(response, Deferred):
            response = await _long_poll(response.arguments, receive)
        elif response.status_code == 429:
            # Over the claim budget: the answer waits out its Retry-After here, where waiting
            # costs a coroutine and nothing else. A client that ignores Retry-After and
            # resends at once (a hostile loop) is held to one claim per connection per
            # Retry-After, so its refusals cannot take the CPU the heartbeats need.
            await _hold(min(float(response["Retry-After"]), MAX_HOLD))
    else:
        response = await longpoll.offload(_api_pool, _call_view, request)
    await django.send_response(finish(request, response), send)


def _call_view(request, close: bool = True) -> HttpResponse:
    match = resolve(request.path_info)
    try:
        response = match.func(request, *match.args, **match.kwargs)
        response.render()
        return response
    finally:
        if close:
            _release()  # drops a broken connection; on PostgreSQL under the listener, back to the pool


def _declared_too_large(request) -> bool:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0) > body_limit()
    except ValueError:
        return False


def _refused(status: int) -> HttpResponse:
    """Django could not even build the request (a body too large for it, an
    undecodable path): answered in the protocol's JSON like every error."""
    if status == 413:
        return _json(error_body("payload_too_large", "the request body is larger than the limit"), 413)
    return _json(error_body("invalid_request", "malformed request"), 400)


async def _principal(request) -> WorkerPrincipal | drf.AuthenticationFailed | None:
    """Who the request is; the refusal, or None for no credentials (the view
    answers 401 for both, without a body read). A credential's lookup is a
    query, so it runs in the pool; the shared token's check is CPU only."""
    try:
        token = bearer_of(request)
        if token is None:
            return None
        if token.startswith(CREDENTIAL_PREFIX):
            return await longpoll.offload(_api_pool, _looked_up, token)
        return principal_of(token)
    except drf.AuthenticationFailed as refused:
        return refused


def _looked_up(token: bytes) -> WorkerPrincipal:
    try:
        return principal_of(token)
    finally:
        _release()


async def _read_capped(receive) -> io.BytesIO | None:
    """The body, at most one byte past the limit (the view answers 413 then);
    None when the client disconnected."""
    limit = body_limit()
    body = io.BytesIO()
    kept = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if kept <= limit:
            part = chunk[: limit + 1 - kept]
            body.write(part)
            kept += len(part)
        if not message.get("more_body", False):
            break
    body.seek(0)
    return body


async def _long_poll(arguments: dict, receive) -> HttpResponse:
    poll = asyncio.create_task(longpoll.claim_with_wait_async(**arguments))
    hangup = asyncio.create_task(_disconnected(receive))
    try:
        await asyncio.wait({poll, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
    if not poll.done():  # the worker is gone: stop waiting for it
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll
        return _json({"jobs": []}, 200)
    try:
        claims = poll.result()
    except Exception as exc:  # noqa: BLE001 - every error is answered, as the DRF handler does
        status, code, message, details, headers = classify(exc)
        return _json(error_body(code, message, details), status, headers)
    return _json({"jobs": [s.claimed_job(claim) for claim in claims]}, 200)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _json(data: dict, status: int, headers: dict | None = None) -> HttpResponse:
    """An answer the way the DRF views render theirs."""
    response = HttpResponse(JSONRenderer().render(data), status=status, content_type="application/json")
    for name, value in (headers or {}).items():
        response[name] = value
    response["Apiary-Protocol"] = str(PROTOCOL_VERSION)
    response["Allow"] = "POST, OPTIONS"  # as DRF's ClaimView answers
    return response

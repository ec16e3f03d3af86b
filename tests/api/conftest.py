"""Fixtures for the worker protocol tests.

Every test of this package runs with the canary worker token: each response
is checked for it (and for `Apiary-Protocol: 1`, and for never being a 5xx)
by the `api`/`raw` helpers, and every log record of every logger, at DEBUG,
is checked for it when the test ends.
"""

import asyncio
import contextlib
import io
import json
import logging
import sys
from dataclasses import dataclass

import pytest
from asgiref.sync import async_to_sync
from django.db import DatabaseError
from django.test import Client
from django.test.client import ClientHandler
from requests.structures import CaseInsensitiveDict

from jobqueue.models import Affinity, Attempt, Job, JobEvent, JobRecord, RequirementSet, Worker, WorkerCredential
from jobqueue.types import WORKER_ID_RE, hash_token
from workflows.models import Task, WorkflowInstance

CANARY = "canary-wt-5c1f0e7b9a2d4863b1e8"
BASE = "/api/worker/v1/"
AUTO = object()  # the token a call needs: the named worker's credential, else the shared (canary) token

QUEUE_MODELS = (
    Job, Attempt, JobEvent, JobRecord, Worker, WorkerCredential, Affinity, WorkflowInstance, Task, RequirementSet
)


@pytest.fixture(autouse=True)
def worker_token(settings):
    settings.APIARY_WORKER_TOKEN = CANARY
    return CANARY


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def record_text(record: logging.LogRecord) -> str:
    """Everything a formatter could print from the record, extras included."""
    text = [record.getMessage(), repr(record.__dict__)]
    if record.exc_info:
        text.append(logging.Formatter().formatException(record.exc_info))
    return "\n".join(text)


@pytest.fixture(autouse=True)
def logs():
    """Every record of every logger at DEBUG, for this test; none may hold the token."""
    handler = _Collect()
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [lg for lg in manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    levels = {lg: lg.level for lg in loggers}
    hooked = [lg for lg in loggers if lg is logging.getLogger() or not lg.propagate]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    for lg in hooked:
        lg.addHandler(handler)
    yield handler.records
    for lg in hooked:
        lg.removeHandler(handler)
    for lg, level in levels.items():
        lg.setLevel(level)
    leaked = [record_text(r) for r in handler.records if CANARY in record_text(r)]
    assert not leaked, f"the worker token appears in log records: {leaked[:3]}"


def check_response(status: int, headers, content: bytes) -> None:
    """What every answer under /api/worker/ must satisfy."""
    assert status < 500 or status == 503, content[:500]  # 503 `unavailable` is documented
    assert headers.get("Apiary-Protocol") == "1", (status, dict(headers))
    assert CANARY.encode() not in content
    assert not any(CANARY in str(v) for v in headers.values())
    body = json.loads(content)
    if status >= 400:
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"code", "message", "details"}, body
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["details"], dict)
    if status == 401:
        assert headers.get("WWW-Authenticate", "").startswith("Bearer"), dict(headers)


_credentials: dict[str, str] = {}  # worker id -> its credential, for this test (see `credential_for`)


@pytest.fixture(autouse=True)
def _forget_credentials():
    _credentials.clear()
    yield
    _credentials.clear()


def credential_for(worker_id: str) -> str:
    """A credential of `worker_id` (issued by the service, as an operator would), the same for the whole test."""
    from jobqueue import services

    if worker_id not in _credentials:
        _credentials[worker_id] = services.credential_issue(worker_id=worker_id)[1]
    return _credentials[worker_id]


def _worker_named(path: str, body) -> str | None:
    """The worker a protocol call acts as: in its path, its body, or its attempt's row."""
    parts = path.removeprefix(BASE).split("?")[0].split("/")
    if parts[0] == "workers" and len(parts) == 3:
        return parts[1]
    if parts[0] == "attempts" and len(parts) >= 3:  # attempts/{id}/heartbeat, …/records/list
        owner = None
        if parts[1].isdigit() and int(parts[1]) < 2**63:
            with contextlib.suppress(DatabaseError):  # a test making every query fail: the call gets its 503
                owner = Attempt.objects.filter(pk=int(parts[1])).values_list("worker_id", flat=True).first()
        return owner or "a-worker"  # an attempt of no worker: any worker may ask about it
    if parts[0] in ("claims", "workers") and isinstance(body, dict) and isinstance(body.get("worker_id"), str):
        return body["worker_id"]
    return None


def token_for(path: str, body) -> str:
    """What a worker would send: its credential once it has one, the shared token to enrol."""
    worker_id = _worker_named(path, body)
    if worker_id is None or worker_id == "embedded":
        return CANARY
    if not WORKER_ID_RE.fullmatch(worker_id):  # a test of bad ids: any worker may send one
        worker_id = "a-worker"
    if path.removeprefix(BASE).startswith("workers/register") and worker_id not in _credentials:
        return CANARY
    return credential_for(worker_id)


def remember(path: str, body, response) -> None:
    """Keep the credential an enrolment answered with."""
    if path.removeprefix(BASE).startswith("workers/register") and response.status_code == 200:
        credential = response.json().get("credential")
        if credential:
            _credentials[body["worker_id"]] = credential


class Api:
    """The Django test client, authenticated as a worker would be (`AUTO`:
    the shared canary token to enrol, then the worker's credential),
    checking every answer."""

    def __init__(self):
        self.client = Client()

    def _headers(self, token, headers, path: str = "", body=None):
        if token is AUTO:
            token = token_for(path, body)
        extra = {} if token is None else {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        extra.update(headers or {})
        return extra

    def post(
        self,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        token=AUTO,
        headers=None,
        content_type="application/json",
    ):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        meta = self._headers(token, headers, BASE + path, body)
        response = self.client.post(BASE + path, data, content_type=content_type, **meta)
        check_response(response.status_code, response.headers, response.content)
        remember(BASE + path, body, response)
        return response

    def get(self, path: str, *, token=AUTO, headers=None, absolute=False):
        full = path if absolute else BASE + path
        response = self.client.get(full, **self._headers(token, headers, full))
        check_response(response.status_code, response.headers, response.content)
        return response

    def request(self, method: str, path: str, **kwargs):
        """Any method, any absolute path."""
        headers = self._headers(kwargs.pop("token", AUTO), kwargs.pop("headers", None), path)
        response = self.client.generic(method, path, **kwargs, **headers)
        check_response(response.status_code, response.headers, response.content)
        return response


class AsgiApi(Api):
    """The same requests through the listener's ASGI application
    (jobqueue.api.asgi in front of Django). asgiref's async_to_sync runs it
    on an event loop in another thread and sends the calls it would make in
    its thread pools back to this thread, so the views use the test's
    database connection and see its transaction, as the WSGI client's do."""

    def __init__(self, monkeypatch):
        from asgiref.sync import sync_to_async
        from django.core.handlers.asgi import ASGIHandler

        from jobqueue import longpoll
        from jobqueue.api import asgi

        monkeypatch.setattr(longpoll, "offload", lambda pool, fn, *a: sync_to_async(fn, thread_sensitive=True)(*a))
        monkeypatch.setattr(asgi, "_release", lambda: None)
        monkeypatch.setattr(longpoll, "_release", lambda: None)
        self.app = asgi.with_worker_protocol(ASGIHandler())
        self.client = UncheckedAsgiClient(self.app)

    def post(self, path, body=None, *, raw=None, token=AUTO, headers=None, content_type="application/json"):
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        response = self.request(
            "POST", BASE + path, data=data, content_type=content_type, token=token, headers=headers, body=body
        )
        remember(BASE + path, body, response)
        return response

    def get(self, path, *, token=AUTO, headers=None, absolute=False):
        return self.request("GET", path if absolute else BASE + path, token=token, headers=headers)

    def request(self, method, path, *, data=b"", content_type=None, token=AUTO, headers=None, body=None, **kwargs):
        assert not kwargs, kwargs
        meta = self._headers(token, headers, path, body)
        if content_type is not None:
            meta["CONTENT_TYPE"] = content_type
        response = asgi_call(self.app, method, path, meta, data.encode() if isinstance(data, str) else data)
        check_response(response.status_code, response.headers, response.content)
        return response


class UncheckedAsgiClient:
    """What tests use of Django's test Client, unchecked: post(path, data, content_type=…, **META)."""

    def __init__(self, app):
        self.app = app

    def post(self, path, data, *, content_type, **meta):
        body = json.dumps(data) if isinstance(data, dict) else data
        return asgi_call(self.app, "POST", path, {"CONTENT_TYPE": content_type, **meta}, body.encode())


def asgi_call(app, method: str, path: str, meta: dict, body: bytes) -> "RawResponse":
    """One HTTP request through an ASGI application; `meta` in Django's
    META spelling (HTTP_X_Y, CONTENT_TYPE) as the test client takes it."""
    path, _, query = path.partition("?")
    headers = [(b"host", b"testserver")]
    for key, value in meta.items():
        name = key.removeprefix("HTTP_") if key.startswith("HTTP_") else key
        value = str(value)
        # Header bytes are bytes: what cannot be latin-1 (a str no WSGI server makes) goes as UTF-8.
        raw = value.encode("latin-1") if value.isascii() or max(value) <= "\xff" else value.encode()
        headers.append((name.lower().replace("_", "-").encode("latin-1"), raw))
    if body and not any(name == b"content-length" for name, _ in headers):
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": headers, "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # no disconnect while the request is answered

    async def send(message):
        sent.append(message)

    async_to_sync(app)(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    response_headers = CaseInsensitiveDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in start["headers"])
    return RawResponse(start["status"], response_headers, content)


@pytest.fixture(params=["wsgi", "asgi"])
def api(request, monkeypatch):
    """The protocol through Django's test client (WSGI), and through the
    listener's ASGI application: every protocol test runs against both."""
    return Api() if request.param == "wsgi" else AsgiApi(monkeypatch)


@dataclass
class RawResponse:
    status_code: int
    headers: dict
    content: bytes

    def json(self):
        return json.loads(self.content)

    def __getitem__(self, header: str) -> str:
        return self.headers[header]


def wsgi_app():
    """The project as a WSGI application, through Django's test handler (which,
    unlike the production one, does not close the test's database connection)."""
    handler = ClientHandler(enforce_csrf_checks=True)

    def app(environ, start_response):
        response = handler(environ)
        start_response(f"{response.status_code} {response.reason_phrase}", list(response.items()))
        return [response.content]

    return app


def raw_post(
    path: str, body: bytes, *, content_length: str | None, terminated: bool, token=AUTO
) -> RawResponse:
    """A POST through a hand-made WSGI environ: Content-Length may be absent or
    lie, and `wsgi.input_terminated` says whether the server delimits the body
    (gunicorn does) as PEP 3333 servers need not."""
    if token is AUTO:
        try:
            token = token_for(BASE + path, json.loads(body))
        except ValueError:
            token = token_for(BASE + path, None)
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": BASE + path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "HTTP_AUTHORIZATION": f"Bearer {token}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": False,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if terminated:
        environ["wsgi.input_terminated"] = True
    if content_length is not None:
        environ["CONTENT_LENGTH"] = content_length
    captured = {}

    def start_response(status, headers):
        captured["status"], captured["headers"] = int(status.split()[0]), dict(headers)

    content = b"".join(wsgi_app()(environ, start_response))
    response = RawResponse(captured["status"], captured["headers"], content)
    check_response(response.status_code, response.headers, response.content)
    return response


def queue_dump() -> dict:
    """Every row of the queue tables, for before/after comparisons; credentials
    this module's helpers issued (scaffolding: what the worker's enrolment
    would have given it) are left out, wherever in the test they were made."""
    dump = {model.__name__: list(model.objects.order_by("pk").values()) for model in QUEUE_MODELS}
    scaffolding = {hash_token(secret) for secret in _credentials.values()}
    dump["WorkerCredential"] = [row for row in dump["WorkerCredential"] if row["digest"] not in scaffolding]
    return dump


@pytest.fixture
def unchanged(db):
    """`with unchanged(): …` asserts the block changed no queue row."""

    class _Unchanged:
        def __enter__(self):
            self.before = queue_dump()

        def __exit__(self, *exc):
            if exc[0] is None:
                assert queue_dump() == self.before, "the request changed queue state"

    return _Unchanged


@dataclass
class World:
    """A registered worker (capacity 3) holding two attempts, a third job queued."""

    worker_id: str
    session: str
    attempts: list  # services.Claim, two of them
    jobs: list

    def endpoints(self) -> list[tuple[str, dict]]:
        """Every POST endpoint with a body it would accept (and act on)."""
        a = self.attempts[0]
        return [
            ("workers/register", {"worker_id": "w-new", "capacity": 1}),
            (f"workers/{self.worker_id}/heartbeat", {"session": self.session, "draining": False, "ready": True}),
            ("claims", {"worker_id": self.worker_id, "session": self.session, "max_jobs": 1, "wait": 0}),
            (f"attempts/{a.attempt_id}/heartbeat", {"token": a.token}),
            (
                f"attempts/{a.attempt_id}/finish",
                {"token": a.token, "outcome": "succeeded", "summary": {}, "error": None},
            ),
        ]


@pytest.fixture
def world(db, clock):
    from tests.factories import claim, enqueue, register

    jobs = [enqueue() for _ in range(3)]
    worker = register("w1", capacity=3)
    credential_for(worker.worker_id)  # as its enrolment would have given it
    credential_for("a-worker")  # who asks about attempts nobody holds
    attempts = claim(worker, max_jobs=2)
    assert len(attempts) == 2
    clock.advance(1)  # so that a heartbeat that got through would change a row
    return World(worker_id=worker.worker_id, session=worker.session, attempts=attempts, jobs=jobs)

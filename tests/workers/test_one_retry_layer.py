"""One retry layer: the HTTP transport sends a call once and hands a 503's
Retry-After up; the caller that knows the call (the claim loop, a job's
finish, registration) is the one that waits, and its log line names that
wait. Sleeps and jitter are injected."""

import json
import logging
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apiary_site.management.commands.worker import Command
from jobqueue.types import Claim
from tests.waiting import wait_for
from workers.backoff import Backoff
from workers.executor import Outcome
from workers.http import HttpTransport
from workers.runtime import WorkerRuntime
from workers.transport import Registration, TransportError, WorkerSpec

WAIT = 10.0  # safety deadline; not a timing assertion
UNAVAILABLE = {"error": {"code": "unavailable", "message": "the database is busy or down", "details": {}}}


class Busy(BaseHTTPRequestHandler):
    """The control plane under load: every call answers 503 with Retry-After: 1."""

    seen: list[str] = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(self.path)
        data = json.dumps(UNAVAILABLE).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.fixture
def busy():
    Busy.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    host, port = httpd.server_address
    yield f"http://{host}:{port}"
    httpd.shutdown()
    httpd.server_close()


SPEC = WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=(), capacity=1)
CALLS = {
    "register": lambda t: t.register(SPEC),
    "claim": lambda t: t.claim(session="s", max_jobs=1, wait=0),
    "finish": lambda t: t.finish(attempt_id=1, token="x", outcome="succeeded", summary={}, error=None),
    "heartbeat": lambda t: t.heartbeat(attempt_id=1, token="x"),
    "worker heartbeat": lambda t: t.worker_heartbeat(session="s", draining=False, ready=True),
}


@pytest.mark.parametrize("call", CALLS)
def test_the_transport_sends_each_call_once_and_hands_retry_after_up(busy, call):
    sleeps = []
    transport = HttpTransport(base_url=busy, token="t", worker_id="w1", sleep=sleeps.append)
    with pytest.raises(TransportError) as raised:
        CALLS[call](transport)
    assert len(Busy.seen) == 1 and sleeps == []
    assert raised.value.retry_after == 1.0


def test_a_one_shot_caller_that_asks_for_attempts_waits_at_least_retry_after_between_them(busy):
    sleeps = []
    transport = HttpTransport(base_url=busy, token="t", worker_id="status", attempts=3, sleep=sleeps.append, rand=lambda: 0.0)
    with pytest.raises(TransportError):
        transport.status()
    assert len(Busy.seen) == 3
    assert sleeps == [1.0, 1.0]  # jitter alone (here 0) would have resent at once


class FakeSignals:
    """The worker command's signals: `received.wait(delay)` is its wait between registrations."""

    def __init__(self):
        self.waits: list[float] = []
        self.received = self

    def wait(self, seconds: float) -> bool:
        self.waits.append(round(seconds, 6))
        return False  # no signal came


class NotYetUp:
    """A runtime whose control plane answers 503 (Retry-After: 1) `failures` times, then registers it."""

    spec = SPEC

    def __init__(self, failures: int):
        self.failures = failures
        self.starts = 0

    def start(self):
        self.starts += 1
        if self.starts <= self.failures:
            exc = TransportError("POST workers/register: HTTP 503 unavailable")
            exc.retry_after = 1.0
            raise exc


def test_registration_waits_what_it_logs_between_tries(caplog):
    caplog.set_level(logging.WARNING, logger="apiary.worker")
    runtime, signals = NotYetUp(failures=4), FakeSignals()
    Command()._start(runtime, signals, backoff=Backoff(base=0.5, cap=10.0, rand=lambda: 1.0))
    assert runtime.starts == 5
    assert signals.waits == [1.5, 1.5, 2.0, 4.0]  # Retry-After (spread) until the backoff is longer
    assert [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", caplog.text)] == signals.waits


class FinishFailsTwice:
    """Claims one job; its finish fails twice with a 503, then is acknowledged."""

    def __init__(self):
        self.finishes = 0
        self.claimed = False

    def register(self, spec):
        return Registration(session="s", lease_duration=30.0, heartbeat_interval=10.0, worker_timeout=30.0)

    def worker_heartbeat(self, **kwargs):
        return False

    def claim(self, **kwargs):
        if self.claimed:
            return []
        self.claimed = True
        return [Claim(job_id=1, attempt_id=1, attempt_number=1, token="x", agent="a", runner="shell",
                      lease_expires_at=None, payload={})]

    def heartbeat(self, **kwargs):
        raise AssertionError("not due in this test")

    def finish(self, **kwargs):
        self.finishes += 1
        if self.finishes <= 2:
            exc = TransportError("POST attempts/1/finish: HTTP 503 unavailable")
            exc.retry_after = 1.0
            raise exc
        return "succeeded"

    def close(self):
        pass


class Done:
    def run(self, claim, cancel, *, grace, journal=None):
        return Outcome("succeeded", {})


def test_a_finish_is_resent_after_the_wait_its_log_names(caplog):
    caplog.set_level(logging.WARNING, logger="apiary.worker")
    sleeps: list[float] = []
    runtime = WorkerRuntime(
        transport=FinishFailsTwice(), spec=SPEC, executor=Done(), claim_wait=0.0,
        monotonic=lambda: 1000.0, sleep=lambda s: sleeps.append(round(s, 6)), rand=lambda: 1.0,
    )
    runtime.start()
    assert runtime.claim_once() == 1
    wait_for(lambda: runtime.finished_count == 1, timeout=WAIT, what="the finish to be acknowledged")
    assert runtime.transport.finishes == 3
    assert sleeps == [1.5, 1.5]
    assert [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", caplog.text)] == sleeps


# ---------------------------------------------------------------- what a call that got no answer says


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent():
    """A control plane that accepts connections and then says nothing (`hang`) or closes them (`close`)."""
    server = socket.create_server(("127.0.0.1", 0))
    held, mode = [], {"close": False}

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if mode["close"]:  # read the whole request first: closing on unread bytes would be a reset
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, body = data.split(b"\r\n\r\n", 1)
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.close()
            else:
                held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", mode
    server.close()
    for conn in held:
        conn.close()


def test_a_refused_connection_is_one_short_line():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(TransportError) as raised:
        HttpTransport(base_url=url, token="t", worker_id="w1").register(SPEC)
    assert raised.value.message == f"cannot reach {url}: connection refused"


def test_no_answer_names_the_timeout(silent):
    url, _ = silent
    with pytest.raises(TransportError) as raised:
        HttpTransport(base_url=url, token="t", worker_id="w1", read_timeout=0.2).register(SPEC)
    assert raised.value.message == f"cannot reach {url}: no answer within 0.2s"


def test_a_connection_closed_without_an_answer_says_so(silent):
    url, mode = silent
    mode["close"] = True
    with pytest.raises(TransportError) as raised:
        HttpTransport(base_url=url, token="t", worker_id="w1").register(SPEC)
    assert raised.value.message == f"cannot reach {url}: the connection closed without an answer"

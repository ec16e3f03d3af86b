"""The HTTP transport's retry policy against a scripted server on loopback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobqueue.exceptions import InvalidRequest, StaleAttempt
from workers.http import HttpTransport
from workers.transport import TransportError


class Scripted(BaseHTTPRequestHandler):
    answers: list[tuple[int, str, str]] = []  # (status, content type, body), one per request
    seen: list[str] = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(self.path)
        status, ctype, body = self.answers.pop(0) if self.answers else (599, "text/plain", "no answer scripted")
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Scripted.answers, Scripted.seen = [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def transport(server) -> HttpTransport:
    host, port = server.server_address
    return HttpTransport(base_url=f"http://{host}:{port}", token="t", worker_id="w1", attempts=3)


def error(status: int, code: str) -> tuple[int, str, str]:
    return status, "application/json", json.dumps({"error": {"code": code, "message": code, "details": {}}})


FINISHED = (200, "application/json", json.dumps({"job_state": "succeeded"}))


def finish(t: HttpTransport) -> str:
    return t.finish(attempt_id=1, token="x", outcome="succeeded", summary={}, error=None)


def test_503_is_retried_then_answered(server):
    Scripted.answers = [error(503, "unavailable"), FINISHED]
    assert finish(transport(server)) == "succeeded"
    assert len(Scripted.seen) == 2


def test_a_4xx_answer_is_not_retried(server):
    Scripted.answers = [error(409, "stale_attempt"), FINISHED]
    with pytest.raises(StaleAttempt):
        finish(transport(server))
    assert len(Scripted.seen) == 1


def test_a_500_is_a_bug_not_a_blip_and_is_not_retried(server):
    Scripted.answers = [(500, "application/json", json.dumps({"error": {"code": "internal_error"}})), FINISHED]
    with pytest.raises(InvalidRequest):
        finish(transport(server))
    assert len(Scripted.seen) == 1


def test_a_2xx_that_is_not_json_is_a_transport_error(server):
    Scripted.answers = [(200, "text/html", "<html>proxy login</html>")]
    with pytest.raises(TransportError):
        finish(transport(server))


def test_a_claim_is_never_resent_by_the_transport(server):
    # Not idempotent: a resent claim would lease more jobs while the first ones' answer was lost.
    Scripted.answers = [error(503, "unavailable"), (200, "application/json", json.dumps({"jobs": []}))]
    with pytest.raises(TransportError):
        transport(server).claim(session="s", max_jobs=1, wait=0)
    assert Scripted.seen == ["/api/worker/v1/claims"]


GOOD_JOB = {
    "job_id": 1, "attempt_id": 2, "attempt_number": 1, "token": "tok", "lease_expires_at": "2030-01-01T00:00:00Z",
    "agent": "sh", "runner": "shell", "workflow": "triage", "instance_id": 5, "task": {"id": 7, "title": "x"},
}


@pytest.mark.parametrize(
    "override",
    [
        pytest.param({"attempt_number": "../../../../outside/pwned"}, id="path-in-attempt-number"),
        pytest.param({"job_id": True}, id="bool-id"),
        pytest.param({"attempt_id": 0}, id="zero-id"),
        pytest.param({"token": 12}, id="token-not-text"),
        pytest.param({"lease_expires_at": "soon"}, id="unparseable-lease"),
        pytest.param({"runner": None}, id="runner-missing"),
    ],
)
def test_a_claimed_job_that_is_not_protocol_v1_is_refused_and_the_others_kept(server, override):
    # A broken or hostile control plane: queue fields become path parts and
    # environment values on the worker, so they are checked before a Claim exists.
    bad = {**GOOD_JOB, "job_id": 9, **override}
    Scripted.answers = [(200, "application/json", json.dumps({"jobs": [bad, GOOD_JOB]}))]
    claims = transport(server).claim(session="s", max_jobs=2, wait=0)
    assert [(c.job_id, c.attempt_number, c.payload) for c in claims] == [
        (1, 1, {"workflow": "triage", "instance_id": 5, "task": {"id": 7, "title": "x"}})
    ]


def test_a_429_is_an_answer_to_wait_on_naming_how_long(server):
    """The claim budget's answer: a retryable TransportError carrying Retry-After, so the claim
    loop's backoff waits at least that long (workers/backoff.py) instead of sending again at once."""

    class Limited(Scripted):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.seen.append(self.path)
            data = json.dumps({"error": {"code": "rate_limited", "message": "slow down", "details": {}}}).encode()
            self.send_response(429)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", "3")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server.RequestHandlerClass = Limited
    with pytest.raises(TransportError) as raised:
        transport(server).claim(session="s", max_jobs=1, wait=0)
    assert raised.value.retry_after == 3.0
    assert len(Scripted.seen) == 1  # a claim is never resent by the transport


def test_a_control_plane_that_lists_no_features_offers_no_journal(server):
    """A control plane from before the journal answers registration without `features`."""
    Scripted.answers = [(200, "application/json", json.dumps({
        "session": "s", "lease_duration": 30, "heartbeat_interval": 10, "worker_timeout": 30,
        "credential": None, "protocol": 1, "worker": {},
    }))]  # fmt: skip
    from workers.transport import WorkerSpec

    spec = WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=(), capacity=1)
    host, port = server.server_address
    transport = HttpTransport(base_url=f"http://{host}:{port}", token="apw_" + "x" * 43, worker_id="w1")
    assert transport.register(spec).features == frozenset()

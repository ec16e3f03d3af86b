"""The HTTP transport keeps one connection pool per concern: claims, heartbeats,
finishes. Against a server on loopback that holds each long poll until the test
releases it; every wait is an event with a deadline as a safety net only."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.http import HttpTransport

WAIT = 10.0  # safety deadline for anything the test set going; not a timing assertion
CAPACITY = 12  # above requests' default pool of 10


class ControlPlane(BaseHTTPRequestHandler):
    """Claims block until `release` is set; heartbeats answer at once; finishes
    answer once `finishes` (a barrier) has as many in flight as it counts."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client's connection is its port

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server = self.server
        kind = self.path.rsplit("/", 1)[-1]
        if "/workers/" in self.path and kind == "heartbeat":
            kind = "worker_heartbeat"
        server.seen.append((kind, self.client_address[1]))
        if kind == "claims":
            server.claim_held.set()
            server.release.wait(WAIT)
            body = {"jobs": []}
        elif kind == "finish":
            server.finishes.wait(WAIT)
            body = {"job_state": "succeeded"}
        elif kind == "worker_heartbeat":
            body = {"drain": False}
        else:
            body = {"lease_expires_at": "2030-01-01T00:00:00Z", "cancel": False}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Set-Cookie", "sessionid=abc; Path=/")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ControlPlane)
    httpd.seen, httpd.claim_held, httpd.release = [], threading.Event(), threading.Event()
    httpd.finishes = threading.Barrier(CAPACITY)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def transport(server):
    host, port = server.server_address
    made = HttpTransport(base_url=f"http://{host}:{port}", token="t", worker_id="w1", capacity=CAPACITY)
    made.beat_timeout = WAIT  # a heartbeat stuck behind the claim would fail here, not hang
    yield made
    for session in made.sessions:
        session.close()


def ports(server, *kinds: str) -> set[int]:
    return {port for kind, port in server.seen if kind in kinds}


def hold_a_claim(server, transport) -> threading.Thread:
    """A long poll in flight on its own thread (the claim loop's), held by the server."""
    claim = threading.Thread(target=lambda: transport.claim(session="s", max_jobs=1, wait=30), daemon=True)
    claim.start()
    assert server.claim_held.wait(WAIT), "the claim never reached the server"
    return claim


def test_a_heartbeat_is_answered_while_a_long_poll_is_in_flight(server, transport):
    claim = hold_a_claim(server, transport)

    beat = transport.heartbeat(attempt_id=1, token="x")
    drain = transport.worker_heartbeat(session="s", draining=False, ready=True)

    assert claim.is_alive() and not server.release.is_set()  # both answered while the claim was held
    assert beat.cancel is False and drain is False
    server.release.set()
    claim.join(WAIT)
    assert not claim.is_alive()


def test_heartbeats_never_go_over_the_long_polls_connection(server, transport):
    # With one pool for both, the claim's connection, once back in the pool,
    # is the next one lent out (the pool is last-in, first-out): to a heartbeat.
    claim = hold_a_claim(server, transport)
    transport.heartbeat(attempt_id=1, token="x")
    server.release.set()
    claim.join(WAIT)
    transport.heartbeat(attempt_id=1, token="x")
    transport.worker_heartbeat(session="s", draining=False, ready=True)

    assert ports(server, "claims") and ports(server, "heartbeat", "worker_heartbeat")
    assert not ports(server, "claims") & ports(server, "heartbeat", "worker_heartbeat")


def test_finishes_from_every_job_thread_at_once_keep_their_connections(server, transport):
    # The finish pool holds `capacity` connections: a second round of as many
    # concurrent finishes reuses the first round's instead of opening new ones
    # (requests' default pool of 10 would discard two of twelve after each round).
    def round_of_finishes() -> set[int]:
        before = len(server.seen)
        threads = [
            threading.Thread(
                target=transport.finish,
                kwargs={"attempt_id": n, "token": "x", "outcome": "succeeded", "summary": {}, "error": None},
                daemon=True,
            )
            for n in range(CAPACITY)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)
        return {port for _, port in server.seen[before:]}

    first = round_of_finishes()
    second = round_of_finishes()
    assert len(first) == CAPACITY
    assert second == first


def test_the_sessions_keep_no_cookies_so_concurrent_requests_share_only_the_pool(server, transport):
    # The cookie jar is the one thing a request writes into its Session; refusing
    # every cookie is what makes one session sound across the job threads.
    claim = hold_a_claim(server, transport)
    transport.heartbeat(attempt_id=1, token="x")
    server.release.set()
    claim.join(WAIT)
    assert [len(session.cookies) for session in transport.sessions] == [0, 0, 0, 0]

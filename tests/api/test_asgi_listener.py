"""The listener's ASGI serving over real sockets (tests/asgi_server.py):
waiting long-polls hold no thread and never delay a heartbeat, a worker
that hangs up stops waiting, the token is checked before a body is read,
and slow or idle sockets are closed by the request deadline."""

import json
import socket
import threading
import time

import pytest
import requests

from jobqueue import longpoll
from jobqueue.api import asgi
from jobqueue.models import Attempt
from jobqueue.wakeup import notifier, watch
from tests.api.conftest import CANARY, credential_for
from tests.asgi_server import AsgiServer
from tests.factories import claim, enqueue, register
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

WAIT = 20.0  # deadline for something the test set going; not a timing assertion
AUTH = {"Authorization": f"Bearer {CANARY}"}


def auth(worker) -> dict:
    """The headers of a call made as `worker`, with its own credential."""
    return {"Authorization": f"Bearer {credential_for(worker.worker_id)}"}


@pytest.fixture(autouse=True)
def token(settings):
    settings.APIARY_WORKER_TOKEN = CANARY


@pytest.fixture(scope="module")
def strict_server():
    """A listener whose clients must send each request within half a second."""
    with AsgiServer(request_timeout=0.5, idle_timeout=0.5) as server:
        yield server


def url(server, path):
    return f"{server.url}/api/worker/v1/{path}"


def raw_long_poll(server, worker, *, wait: float) -> socket.socket:
    """A long-poll sent on a socket of its own, which the test may close."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"worker_id": worker.worker_id, "session": worker.session, "wait": wait}).encode()
    sock.sendall(
        b"POST /api/worker/v1/claims HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {credential_for(worker.worker_id)}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def long_poll(server, worker, wait, results):
    body = {"worker_id": worker.worker_id, "session": worker.session, "wait": wait}
    with requests.Session() as session:
        results.append(session.post(url(server, "claims"), json=body, headers=auth(worker), timeout=wait + WAIT).json())


def test_waiting_long_polls_hold_no_thread_and_heartbeats_pass(asgi_server, clock):
    """More waiting long-polls than the old listener had threads (32): the
    process has no more threads than before they came, and an attempt
    heartbeat is answered while they all wait."""
    enqueue()
    busy = register("busy")
    [attempt] = claim(busy)
    idle = [register(f"idle-{i}") for i in range(40)]
    for worker in [busy, *idle]:
        credential_for(worker.worker_id)  # before the count: the pollers' threads must not issue them
    watch.ensure_running()  # the process's one watcher thread, whichever test started it first: not a waiter's
    before = threading.active_count()
    results: list = []
    pollers = [threading.Thread(target=long_poll, args=(asgi_server, w, 30, results)) for w in idle]
    for poller in pollers:
        poller.start()
    wait_for(lambda: notifier.waiting() == 40, timeout=WAIT, what="40 long-polls waiting")
    server_threads = threading.active_count() - before - len(pollers)  # the pollers are this test's own
    # The fixed pools' worth at most (credential lookups, claim rounds), not one per waiter.
    assert server_threads <= asgi.API_THREADS + longpoll.CLAIM_THREADS < len(idle), server_threads
    answer = requests.post(url(asgi_server, f"attempts/{attempt.attempt_id}/heartbeat"), json={"token": attempt.token},
                           headers=auth(busy), timeout=WAIT)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["cancel"] is False
    for _ in range(40):
        enqueue()
    for poller in pollers:
        poller.join(timeout=WAIT)
    assert sorted(len(r["jobs"]) for r in results) == [1] * 40  # every waiter got one job


def test_a_worker_that_hangs_up_stops_waiting(asgi_server, clock):
    worker = register()
    sock = raw_long_poll(asgi_server, worker, wait=30)
    wait_for(lambda: notifier.waiting() == 1, timeout=WAIT, what="the long-poll to wait")
    sock.close()
    wait_for(lambda: notifier.waiting() == 0, timeout=WAIT, what="the wait to end with the connection")
    enqueue()
    assert not Attempt.objects.exists()  # nothing was claimed for the worker that left


def test_the_token_is_checked_before_the_body_is_read(asgi_server):
    """A client without the token is answered 401 although it has not sent
    the 10 MB body it announced: nothing of it was read or stored."""
    with socket.create_connection(("127.0.0.1", asgi_server.port), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /api/worker/v1/claims HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000\r\n\r\n{"
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")


def test_a_body_over_the_limit_is_refused(asgi_server, clock):
    worker = register()
    padding = "x" * (1024 * 1024)
    body = {"worker_id": worker.worker_id, "session": worker.session, "pad": padding}
    answer = requests.post(url(asgi_server, "claims"), json=body, headers=auth(worker), timeout=WAIT)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "payload_too_large"


def read_response(sock) -> bytes:
    """One whole HTTP response (headers and its Content-Length of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return data


def closed_after(sock, *, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending `trickle` a byte at a
    time meanwhile. A close shows as end-of-file or, with bytes of ours still
    unread on the server's side, as a reset."""
    start = time.monotonic()
    sock.settimeout(0.1)
    try:
        for byte in trickle:
            try:
                if sock.recv(1) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                pass
            sock.sendall(bytes([byte]))
        sock.settimeout(WAIT)
        assert sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass
    return time.monotonic() - start


def test_a_client_trickling_its_headers_is_cut_off(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port)) as sock:
        elapsed = closed_after(sock, trickle=b"GET /api/worker/v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200)
    assert elapsed < WAIT  # it was the deadline, not the end of the trickle, that closed it


def test_an_idle_socket_is_closed_and_others_are_served_meanwhile(strict_server):
    sockets = [socket.create_connection(("127.0.0.1", strict_server.port)) for _ in range(50)]
    status = requests.get(url(strict_server, "status"), headers=AUTH, timeout=WAIT)
    assert status.status_code == 200
    for sock in sockets:
        closed_after(sock)
        sock.close()


def test_a_declared_body_over_the_limit_is_refused_unread(asgi_server, clock):
    with socket.create_connection(("127.0.0.1", asgi_server.port), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /api/worker/v1/claims HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {CANARY}\r\nContent-Length: 5000000\r\n\r\n".encode()
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")


def test_a_socket_answered_before_its_body_still_has_a_deadline(strict_server):
    """A 401 goes out before the body is read; a client that then sends the
    body and keeps the socket must still be cut off."""
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=WAIT) as sock:
        sock.sendall(b"POST /api/worker/v1/claims HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 401 ")
        sock.sendall(b"{}")
        closed_after(sock)


def test_a_claim_round_cut_short_by_a_hang_up_gives_its_jobs_back(asgi_server, clock, monkeypatch):
    """The worker hangs up while its claim round is in the database: the
    round ends, and what it leased is expired at once rather than when the
    lease runs out."""
    from jobqueue import services
    from jobqueue.api import asgi

    entered, release, hung_up = threading.Event(), threading.Event(), threading.Event()
    real = services.claim_round
    real_disconnected = asgi._disconnected

    async def disconnected(receive):
        await real_disconnected(receive)
        hung_up.set()

    monkeypatch.setattr(asgi, "_disconnected", disconnected)

    def slow_round(**kwargs):
        entered.set()
        assert release.wait(WAIT)
        return real(**kwargs)

    monkeypatch.setattr(services, "claim_round", slow_round)
    enqueue()
    worker = register()
    sock = raw_long_poll(asgi_server, worker, wait=30)
    assert entered.wait(WAIT)
    sock.close()
    assert hung_up.wait(WAIT)  # the server saw it while the round was still running
    release.set()
    wait_for(lambda: Attempt.objects.filter(state="expired").exists(), timeout=WAIT, what="the attempt given back")
    assert Attempt.objects.get().error.startswith("the worker hung up")


def test_a_worker_at_capacity_does_not_take_the_wake_of_an_idle_one(asgi_server, clock, monkeypatch):
    """A worker full on the control plane's count long-polls first; one job
    is enqueued: the idle worker gets it at once, not after a fallback."""
    enqueue()
    full = register("full")
    claim(full)
    idle = register("idle")
    results: list = []
    first = threading.Thread(target=long_poll, args=(asgi_server, full, 5, results))
    first.start()
    wait_for(lambda: notifier.waiting() == 1, timeout=WAIT, what="the full worker's long-poll")
    second_results: list = []
    second = threading.Thread(target=long_poll, args=(asgi_server, idle, 5, second_results))
    second.start()
    wait_for(lambda: notifier.waiting() == 2, timeout=WAIT, what="both long-polls")
    monkeypatch.setattr(notifier, "_next_fallback", float("inf"))  # no fallback turn may rescue it
    enqueue()
    second.join(timeout=WAIT)
    assert len(second_results[0]["jobs"]) == 1
    first.join(timeout=WAIT)

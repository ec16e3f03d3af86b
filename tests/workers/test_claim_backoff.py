"""The claim loop's load on a control plane that is down or overloaded is
bounded: failed claims back off (capped exponential, full jitter, never sooner
than a 503's Retry-After, reset by a success), the log names the wait the loop
then makes, and heartbeats keep their own cadence meanwhile.

The runtime runs against a scripted transport with an injected jitter, a fake
monotonic clock and an injected backoff wait that records what it was asked to
wait (and drains the worker when the test has seen enough): nothing sleeps."""

import logging
import re
import socket
import threading

import pytest

from jobqueue.exceptions import InvalidRequest
from jobqueue.types import Heartbeat
from workers.http import HttpTransport
from workers.runtime import WorkerRuntime
from workers.transport import Registration, TransportError, WorkerSpec

LEASE, BEAT = 30.0, 10.0


class FakeMonotonic:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedTransport:
    """Claims answer from `claims` (an exception is raised, a list returned;
    once it runs out every claim fails); records which thread sent what."""

    def __init__(self, claims=(), *, down: bool = False):
        self.claims = list(claims)
        self.down = down  # worker and attempt heartbeats fail too
        self.sent: list[tuple[str, str]] = []  # (call, thread name)

    def _record(self, name: str) -> None:
        self.sent.append((name, threading.current_thread().name))
        if self.down and name != "claim":
            raise TransportError(f"{name}: connection refused (test)")

    def register(self, spec):
        return Registration(session="s", lease_duration=LEASE, heartbeat_interval=BEAT, worker_timeout=LEASE)

    def worker_heartbeat(self, *, session, draining, ready):
        self._record("worker_heartbeat")
        return False

    def claim(self, *, session, max_jobs, wait):
        self._record("claim")
        answer = self.claims.pop(0) if self.claims else TransportError("claim: connection refused (test)")
        if isinstance(answer, Exception):
            raise answer
        return answer

    def heartbeat(self, *, attempt_id, token):
        self._record("heartbeat")
        return Heartbeat(lease_expires_at=None, cancel=False)

    def finish(self, **kwargs):
        raise AssertionError("no job is claimed in these tests")

    def close(self):
        pass


def unavailable(retry_after: float | None = None) -> TransportError:
    exc = TransportError("POST claims: HTTP 503 unavailable: the database is busy or down")
    exc.retry_after = retry_after
    return exc


def runtime_of(transport, *, rand=lambda: 1.0) -> WorkerRuntime:
    runtime = WorkerRuntime(
        transport=transport,
        spec=WorkerSpec(worker_id="w1", pool=None, labels=(), capabilities=(), capacity=1),
        executor=None,
        claim_wait=0.0,
        monotonic=FakeMonotonic(),
        rand=rand,
    )
    runtime.start()
    return runtime


def run_until(runtime: WorkerRuntime, waits: int) -> list[float]:
    """Run the claim loop until it has backed off `waits` times; the waits."""
    seen: list[float] = []

    def wait(seconds: float) -> None:
        seen.append(round(seconds, 6))
        if len(seen) == waits:
            runtime.request_drain("the test has seen enough")

    runtime.wait = wait
    loop = threading.Thread(target=runtime.run, name="claim-loop", daemon=True)
    loop.start()
    loop.join(10.0)  # safety deadline
    assert not loop.is_alive(), f"the claim loop did not drain after {seen}"
    return seen


def claims_sent(transport) -> int:
    return sum(1 for name, thread in transport.sent if name == "claim" and thread == "claim-loop")


def logged_waits(caplog) -> list[float]:
    return [float(m) for m in re.findall(r"claiming again in ([0-9.]+)s", caplog.text)]


def test_failing_claims_back_off_exponentially_up_to_the_cap_one_claim_per_wait(caplog):
    caplog.set_level(logging.WARNING, logger="apiary.worker")
    transport = ScriptedTransport()
    waits = run_until(runtime_of(transport), 8)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0]
    assert claims_sent(transport) == 8
    assert logged_waits(caplog) == waits  # the log says what the loop then waited


def test_the_wait_is_jittered_below_the_ceiling():
    waits = run_until(runtime_of(ScriptedTransport(), rand=lambda: 0.25), 3)
    assert waits == [0.125, 0.25, 0.5]


def test_a_503s_retry_after_is_the_shortest_wait():
    transport = ScriptedTransport([unavailable(retry_after=1.0)] * 3)
    waits = run_until(runtime_of(transport, rand=lambda: 0.0), 3)
    assert waits == [1.0, 1.0, 1.0]  # full jitter alone could have come straight back


def test_a_successful_claim_resets_the_backoff():
    transport = ScriptedTransport([unavailable(), unavailable(), unavailable(), [], unavailable()])
    waits = run_until(runtime_of(transport), 4)
    assert waits == [0.5, 1.0, 2.0, 0.5]
    assert claims_sent(transport) == 5


def test_an_unexpected_claim_answer_backs_off_by_the_same_policy():
    transport = ScriptedTransport([InvalidRequest("POST claims: HTTP 500 internal_error: boom")] * 2)
    waits = run_until(runtime_of(transport), 2)
    assert waits == [0.5, 1.0]


def test_probing_a_control_plane_not_reached_for_half_a_lease_backs_off_too():
    transport = ScriptedTransport(down=True)
    runtime = runtime_of(transport)
    runtime.monotonic.now += LEASE / 2  # not reached since registering: the loop probes instead of claiming
    waits = run_until(runtime, 4)
    assert waits == [0.5, 1.0, 2.0, 4.0]
    probes = [name for name, thread in transport.sent if thread == "claim-loop"]
    assert probes[:4] == ["worker_heartbeat"] * 4 and claims_sent(transport) == 0


@pytest.mark.parametrize("control_plane_down", [False, True])
def test_heartbeats_keep_their_cadence_however_far_the_claims_backed_off(control_plane_down):
    # Leases depend on heartbeats: one try each, the next round beats again,
    # whatever the claim loop's backoff has reached.
    transport = ScriptedTransport([[]] + [unavailable()] * 10, down=control_plane_down)
    runtime = runtime_of(transport)
    runtime.claim_once()
    for _ in range(10):
        runtime.claim_once()
    assert runtime.claim_delay == 20.0  # the claim loop would now wait its cap
    sent_before = len(transport.sent)
    for _ in range(3):
        runtime.monotonic.now += BEAT
        runtime.heartbeat_once()
    assert [name for name, _ in transport.sent[sent_before:]] == ["worker_heartbeat"] * 3


class Unreachable(HttpTransport):
    """The real HTTP transport, registered, its control plane then gone (nothing listens on the port)."""

    def register(self, spec):
        return Registration(session="s", lease_duration=LEASE, heartbeat_interval=BEAT, worker_timeout=LEASE)


def test_against_a_real_closed_port_each_claim_failure_is_one_short_line_naming_the_wait(caplog):
    caplog.set_level(logging.WARNING, logger="apiary.worker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    waits = run_until(runtime_of(Unreachable(base_url=url, token="t", worker_id="w1")), 3)
    lines = [r.getMessage() for r in caplog.records if "claim failed" in r.getMessage()]
    assert lines == [
        f"worker w1: claim failed (cannot reach {url}: connection refused); claiming again in {wait:.2f}s "
        f"({n} failure(s) in a row)"
        for n, wait in enumerate(waits, start=1)
    ]

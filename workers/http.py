"""The remote worker's transport: the worker protocol v1 over HTTP.

One `requests.Session` (keep-alive), connect and read timeouts, retries with
jittered exponential backoff on connection errors and 503 — never on other
4xx, which are answers, not accidents. Error codes come back as the same
domain exceptions the in-process transport raises.
"""

import datetime as dt
import logging
import os
import random
import socket
import time

import requests

from jobqueue.exceptions import InvalidRequest, NotFound, SessionSuperseded, StaleAttempt
from jobqueue.types import CLAIM_FIELDS, Claim, Heartbeat

from .transport import Registration, TransportError, Unauthorized, WorkerSpec

log = logging.getLogger("apiary.worker")

PROTOCOL_PATH = "/api/worker/v1/"
RETRY_STATUSES = frozenset({502, 503, 504})  # the control plane (or its proxy) is briefly unavailable
ERRORS = {
    "stale_attempt": StaleAttempt,
    "session_superseded": SessionSuperseded,
    "not_found": NotFound,
    "unsupported_protocol": NotFound,
    "invalid_request": InvalidRequest,
    "unauthorized": Unauthorized,
    "payload_too_large": InvalidRequest,
}


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _claim_of(job: dict) -> Claim:
    """A claimed job from the wire, its queue fields checked (ids become path
    parts and environment values on the worker)."""
    ids = {name: job[name] for name in ("job_id", "attempt_id", "attempt_number")}
    for name, value in ids.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    texts = {name: job[name] for name in ("token", "agent", "runner")}
    for name, value in texts.items():
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return Claim(
        **ids,
        **texts,
        lease_expires_at=parse_time(job["lease_expires_at"]),
        # Protocol v1 sends the payload's keys beside the queue's own fields.
        payload={key: value for key, value in job.items() if key not in CLAIM_FIELDS},
    )


class HttpTransport:
    def __init__(
        self,
        *,
        base_url: str,
        token: str,
        worker_id: str,
        ca_cert: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 15.0,
        attempts: int = 4,
        version: str = "",
    ):
        self.base = base_url.rstrip("/") + PROTOCOL_PATH
        self.worker_id = worker_id
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.attempts = attempts
        self.version = version
        self.beat_timeout = read_timeout  # one heartbeat interval, once registered
        self.session = requests.Session()
        self.session.headers.update({"Authorization": f"Bearer {token}", "Accept": "application/json"})
        # Passed with every request: requests lets $REQUESTS_CA_BUNDLE override a
        # session-level `verify`, but not a per-request one.
        self.verify: str | bool = ca_cert or True

    def _call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        extra_read: float = 0.0,
        quick: bool = False,
        once: bool = False,
    ) -> dict:
        """One protocol call. Connection errors and 502/503/504 are retried with
        jittered backoff; other answers are not (a 4xx is an answer, a 500 a bug).
        `quick` calls (heartbeats) try once with a read timeout of one heartbeat
        interval: the runtime beats again next round, and one hung request must
        not hold up the heartbeats of every other job. `once` calls (claims) are
        not retried here because they are not idempotent: a claim whose answer
        was lost leased jobs nobody will run (their leases run out)."""
        delay = 0.25
        attempts = 1 if (quick or once) else self.attempts
        read = self.beat_timeout if quick else self.read_timeout + extra_read
        for attempt in range(1, attempts + 1):
            try:
                response = self.session.request(
                    method, self.base + path, json=body, timeout=(self.connect_timeout, read), verify=self.verify
                )
            except requests.RequestException as exc:
                failure = TransportError(f"{method} {path}: {type(exc).__name__}: {exc}")
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError as exc:  # not the control plane answering (a proxy's page?)
                        raise TransportError(f"{method} {path}: HTTP {response.status_code} but not JSON") from exc
                try:
                    error = response.json()["error"]
                except (ValueError, KeyError, TypeError):
                    error = {"code": "", "message": f"HTTP {response.status_code}"}
                code, message = error.get("code", ""), error.get("message", "")
                if response.status_code < 500 and code in ERRORS:
                    exc = ERRORS[code](message)
                    exc.details = error.get("details") or {}  # not as keywords: a detail may be called "message"
                    raise exc
                if response.status_code not in RETRY_STATUSES:
                    raise InvalidRequest(f"{method} {path}: HTTP {response.status_code} {code}: {message}")
                failure = TransportError(f"{method} {path}: HTTP {response.status_code} {code}: {message}")
            if attempt == attempts:
                raise failure
            time.sleep(delay * random.uniform(0.5, 1.5))  # jitter: no lockstep between workers
            delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def register(self, spec: WorkerSpec) -> Registration:
        answer = self._call(
            "POST",
            "workers/register",
            {
                "worker_id": spec.worker_id,
                "pool": spec.pool,
                "labels": list(spec.labels),
                "capabilities": list(spec.capabilities),
                "capacity": spec.capacity,
                "version": self.version,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
            },
        )
        self.beat_timeout = max(1.0, float(answer["heartbeat_interval"]))
        return Registration(
            session=answer["session"],
            lease_duration=float(answer["lease_duration"]),
            heartbeat_interval=float(answer["heartbeat_interval"]),
            worker_timeout=float(answer["worker_timeout"]),
        )

    def worker_heartbeat(self, *, session: str, draining: bool, ready: bool) -> bool:
        answer = self._call(
            "POST",
            f"workers/{self.worker_id}/heartbeat",
            {"session": session, "draining": draining, "ready": ready},
            quick=True,
        )
        return bool(answer["drain"])

    def claim(self, *, session: str, max_jobs: int, wait: float) -> list[Claim]:
        answer = self._call(
            "POST",
            "claims",
            {"worker_id": self.worker_id, "session": session, "max_jobs": max_jobs, "wait": wait},
            extra_read=wait,
            once=True,
        )
        claims = []
        for job in answer["jobs"]:
            try:
                claims.append(_claim_of(job))
            except (KeyError, TypeError, ValueError) as exc:
                # Not what protocol v1 sends: a broken or hostile control plane. The job's lease
                # runs out on its own; nothing from it reaches a runner or a file path.
                log.error("claim answer refused: a job that is not a protocol v1 job (%s)", exc)
        return claims

    def heartbeat(self, *, attempt_id: int, token: str) -> Heartbeat:
        answer = self._call("POST", f"attempts/{attempt_id}/heartbeat", {"token": token}, quick=True)
        return Heartbeat(lease_expires_at=parse_time(answer["lease_expires_at"]), cancel=bool(answer["cancel"]))

    def finish(self, *, attempt_id: int, token: str, outcome: str, summary: dict, error: str | None) -> str:
        answer = self._call(
            "POST",
            f"attempts/{attempt_id}/finish",
            {"token": token, "outcome": outcome, "summary": summary, "error": error},
        )
        return answer["job_state"]

    def status(self) -> dict:
        return self._call("GET", "status")

    def close(self) -> None:
        """Job threads call this when they end; the session stays for the others."""

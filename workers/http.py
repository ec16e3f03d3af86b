"""The remote worker's transport: the worker protocol v1 over HTTP.

One `requests.Session` (a keep-alive connection pool) per concern, so that no
call waits for, or reuses, a connection another concern holds:

* `claims`: the long poll, which holds its connection for up to `wait` plus
  the read timeout. Only the claim loop claims, one claim at a time: a pool of
  one, used by that one thread.
* `beats`: attempt and worker heartbeats, the calls every lease depends on.
  The heartbeat thread sends them; the claim loop sends a few (the heartbeat
  that confirms a claim answered late, the worker heartbeat that probes an
  unreachable control plane, the last `ready: false` once the heartbeat
  thread has ended): a pool of two. A long poll or a slow finish never holds
  one of its connections.
* `logs`: a running step's output (`POST attempts/{id}/logs`), sent by each
  job's log sender thread (workers/logstream.py): a pool of `capacity`, so a
  chunk never waits behind a finish or a heartbeat, nor they behind it.
* `calls`: finishes, registration, status. Finishes come from the job
  threads, up to `capacity` at once (registration and the outbox flush run
  before any job thread exists): a pool of `capacity`. Not the heartbeat
  pool: a finish is not quick (a large summary, a busy database, a full read
  timeout, a resend), so the heartbeat pool stays small, warm and free.

A pool never blocks (requests' default): a request beyond its size opens a
connection and drops it afterwards. The sizes are what the threads using each
pool need, so in steady state every call reuses a kept-alive connection.

Thread safety: requests does not document `Session` as thread-safe. These
sessions are configured completely here and never changed afterwards
(headers, adapters); the one thing a request writes into its session, the
cookie jar, refuses every cookie (the protocol uses none), so concurrent
requests on `beats` or `calls` share only urllib3's connection pool, which is
thread-safe and lends each connection to one request at a time.

Connect and read timeouts; errors come back as the same domain exceptions the
in-process transport raises. Retrying is the caller's (workers/backoff.py):
by default every call is tried once, so the runtime's loops and the worker
command's registration loop are the only retry layer. `attempts` > 1 is for one-shot callers such as `apiary status`: then
connection errors and 502/503/504 are retried with the same jittered backoff
(honouring `Retry-After`), never other 4xx, which are answers, not accidents.
"""

import datetime as dt
import http.client
import http.cookiejar
import logging
import os
import random
import socket
import time

import requests
from requests.adapters import HTTPAdapter

from jobqueue.exceptions import Forbidden, InvalidRequest, NotFound, QueueError, SessionSuperseded, StaleAttempt
from jobqueue.types import CREDENTIAL_PREFIX, MAX_LOG_OFFSET, Claim, Heartbeat, LogState, Record

from . import claimcheck, recordcheck
from .backoff import Backoff, retry_after_of
from .credentials import CREDENTIAL_RE, CredentialFile
from .transport import Registration, TransportError, Unauthorized, WorkerSpec

log = logging.getLogger("apiary.worker")

PROTOCOL_PATH = "/api/worker/v1/"
# The control plane (or its proxy) is briefly unavailable, or asks this worker to slow down (429).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
ERRORS = {
    "stale_attempt": StaleAttempt,
    "session_superseded": SessionSuperseded,
    "not_found": NotFound,
    "unsupported_protocol": NotFound,
    "invalid_request": InvalidRequest,
    "unauthorized": Unauthorized,
    "payload_too_large": InvalidRequest,
    **{error.code: error for error in Forbidden.__subclasses__()},
}


def parse_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _root(exc: BaseException) -> BaseException:
    """The innermost cause of a requests error: requests wraps urllib3's
    MaxRetryError, which wraps NewConnectionError, which wraps the OSError."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        candidates = (exc.__cause__, getattr(exc, "reason", None), *exc.args)  # ProtocolError: (text, the cause)
        inner = next((c for c in candidates if isinstance(c, BaseException)), None)
        if inner is None:
            break
        exc = inner
    return exc


def why_unreachable(exc: requests.RequestException, *, connect_timeout: float, read_timeout: float) -> str:
    """A few words for a call that got no answer ("connection refused"), never
    urllib3's repr of its whole chain (hundreds of characters per line)."""
    if isinstance(exc, requests.ConnectTimeout):
        return f"no connection within {connect_timeout:g}s"
    if isinstance(exc, requests.ReadTimeout):
        return f"no answer within {read_timeout:g}s"
    root = _root(exc)
    if isinstance(exc, requests.exceptions.SSLError):
        return f"TLS failed: {getattr(root, 'reason', None) or getattr(root, 'strerror', None) or type(root).__name__}"
    if isinstance(root, socket.gaierror):
        return "host name not found" if root.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) else (
            f"host name lookup failed ({root.strerror})"
        )
    if isinstance(root, http.client.RemoteDisconnected):  # before ConnectionResetError, its base class
        return "the connection closed without an answer"
    if isinstance(root, ConnectionRefusedError):
        return "connection refused"
    if isinstance(root, ConnectionResetError):
        return "connection reset"
    if isinstance(root, OSError) and root.strerror:
        return root.strerror[:1].lower() + root.strerror[1:]
    return type(root).__name__  # its text may be a repr of everything above; the class says enough


def _session(*, token: str, pool: int) -> requests.Session:
    """A session for one concern: its own pool of `pool` keep-alive connections, no cookies."""
    session = requests.Session()
    session.headers.update({"Accept": "application/json"})
    _authorize(session, token)
    session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _authorize(session: requests.Session, token: str) -> None:
    session.headers["Authorization"] = f"Bearer {token}"


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
        attempts: int = 1,
        capacity: int = 1,
        version: str = "",
        credential_file: CredentialFile | None = None,
        sleep=time.sleep,
        rand=random.random,
    ):
        """`token` is the shared worker token (it enrols this worker, whose
        credential then goes to `credential_file`) or the worker's own
        credential (`apw_…`, issued by an operator). A credential already in
        `credential_file` is used from the first call: the outbox's finishes
        go before registration."""
        self.base = base_url.rstrip("/") + PROTOCOL_PATH
        self.worker_id = worker_id
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.attempts = attempts
        self.version = version
        self.beat_timeout = read_timeout  # one heartbeat interval, once registered
        self.sleep = sleep  # between attempts, when attempts > 1; tests pass a fake one
        self.rand = rand  # that backoff's jitter, uniform in [0, 1)
        self.url = base_url.rstrip("/")
        self.credential_file = credential_file
        # An operator-issued credential given on the command line wins over the stored one (it is
        # how a credential rotates) and is stored once it has registered.
        self.given = token if token.startswith(CREDENTIAL_PREFIX) else None
        self.enrolling = self.given is None  # the shared token, until enrolled
        stored = None
        if self.enrolling and credential_file is not None:
            stored = credential_file.load(self.url)  # CredentialElsewhere: another control plane's
        if stored:
            token, self.enrolling = stored, False
        self.claims = _session(token=token, pool=1)
        self.beats = _session(token=token, pool=2)
        self.calls = _session(token=token, pool=max(1, capacity))
        self.logs = _session(token=token, pool=max(1, capacity))
        # Passed with every request: requests lets $REQUESTS_CA_BUNDLE override a
        # session-level `verify`, but not a per-request one.
        self.verify: str | bool = ca_cert or True

    @property
    def sessions(self) -> tuple[requests.Session, ...]:
        return (self.claims, self.beats, self.calls, self.logs)

    def _call(
        self,
        session: requests.Session,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        extra_read: float = 0.0,
        quick: bool = False,
        once: bool = False,
    ) -> dict:
        """One protocol call on `session`. Connection errors and 502/503/504
        raise TransportError (carrying the answer's Retry-After, if any); other
        answers are not retried (a 4xx is an answer, a 500 a bug). With
        `attempts` > 1 the retryable failures are retried here with jittered
        backoff, except `quick` calls (heartbeats: one try with a read timeout
        of one heartbeat interval; the runtime beats again next round) and
        `once` calls (claims: not idempotent, a claim whose answer was lost
        leased jobs nobody will run until their leases run out)."""
        attempts = 1 if (quick or once) else self.attempts
        backoff = Backoff(base=0.25, cap=5.0, rand=self.rand)
        read = self.beat_timeout if quick else self.read_timeout + extra_read
        for attempt in range(1, attempts + 1):
            try:
                response = session.request(
                    method, self.base + path, json=body, timeout=(self.connect_timeout, read), verify=self.verify
                )
            except requests.RequestException as exc:
                why = why_unreachable(exc, connect_timeout=self.connect_timeout, read_timeout=read)
                failure = TransportError(f"cannot reach {self.url}: {why}")
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
                failure.retry_after = retry_after_of(response.headers.get("Retry-After"))
            if attempt == attempts:
                raise failure
            self.sleep(backoff.failed(failure.retry_after))
        raise AssertionError("unreachable")

    def _use(self, token: str) -> None:
        """Authorise every later call with `token`. Only registration calls it,
        before any other thread sends anything (the sessions are otherwise
        never changed: see the module's note on thread safety)."""
        for session in self.sessions:
            _authorize(session, token)

    def register(self, spec: WorkerSpec) -> Registration:
        """Register. Enrolling (the shared token), the answer's credential is
        checked, stored and used from then on. With a stored credential the
        shared token is never sent: a refusal is final (revoked, or unknown
        to this control plane), and the operator decides what happens next."""
        try:
            answer = self._register(spec)
        except Unauthorized as exc:
            if self.credential_file is None or self.enrolling or self.given:
                raise
            raise Unauthorized(
                f"{exc.message}: the credential in {self.credential_file.path} is revoked or unknown to "
                f"this control plane; an operator can issue a new one (apiary worker token create "
                f"{spec.worker_id}), or delete that file to enrol again with the shared token"
            ) from exc
        if self.enrolling:
            credential = answer.get("credential")
            if not isinstance(credential, str) or not CREDENTIAL_RE.fullmatch(credential):
                raise InvalidRequest("the control plane's enrolment answer has no valid credential")
            if self.credential_file is not None:
                self.credential_file.save(self.url, credential)
            self._use(credential)
            self.enrolling = False
        elif self.given and self.credential_file is not None:
            self.credential_file.save(self.url, self.given)  # later starts need no --token-file
            self.given = None
        self.beat_timeout = max(1.0, float(answer["heartbeat_interval"]))
        return Registration(
            session=answer["session"],
            lease_duration=float(answer["lease_duration"]),
            heartbeat_interval=float(answer["heartbeat_interval"]),
            worker_timeout=float(answer["worker_timeout"]),
            features=frozenset(f for f in answer.get("features") or () if isinstance(f, str)),
        )

    def _register(self, spec: WorkerSpec) -> dict:
        return self._call(
            self.calls,
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
                **({"enrollment_key": self.credential_file.enrolment_key()} if self.enrolling and self.credential_file else {}),
            },
        )

    def worker_heartbeat(self, *, session: str, draining: bool, ready: bool) -> bool:
        answer = self._call(
            self.beats,
            "POST",
            f"workers/{self.worker_id}/heartbeat",
            {"session": session, "draining": draining, "ready": ready},
            quick=True,
        )
        return bool(answer["drain"])

    def claim(self, *, session: str, max_jobs: int, wait: float) -> list[Claim]:
        answer = self._call(
            self.claims,
            "POST",
            "claims",
            {"worker_id": self.worker_id, "session": session, "max_jobs": max_jobs, "wait": wait},
            extra_read=wait,
            once=True,
        )
        # Every field checked before a Claim exists (workers/claimcheck.py says what is accepted).
        claims, refused = claimcheck.claims_of(answer)
        for problem in refused:
            self._refuse(problem)
        return claims

    def _refuse(self, problem: claimcheck.ClaimRefused) -> None:
        """A claimed job that is not what protocol v1 sends (a broken or hostile
        control plane): never run. Its attempt is finished `failed` with the
        reason when its id and token are usable, else its lease runs out."""
        log.error("claim answer refused: job %s is not a protocol v1 job: %s", problem.job_id, problem.reason)
        if problem.attempt_id is None:
            return
        try:
            self.finish(
                attempt_id=problem.attempt_id, token=problem.token, outcome="failed", summary={},
                error=f"worker {self.worker_id} refused the claim: {problem.reason}",
            )
        except QueueError as exc:
            log.warning("attempt %s: could not report the refused claim (%s); its lease will run out", problem.attempt_id, exc)

    def heartbeat(self, *, attempt_id: int, token: str, checkpoint: tuple[str, str] | None = None) -> Heartbeat:
        body: dict = {"token": token}
        if checkpoint is not None:  # sent only when there is one: a control plane before checkpoints refuses the field
            body["checkpoint"] = {"step": checkpoint[0], "content": checkpoint[1]}
        answer = self._call(self.beats, "POST", f"attempts/{attempt_id}/heartbeat", body, quick=True)
        return Heartbeat(lease_expires_at=parse_time(answer["lease_expires_at"]), cancel=bool(answer["cancel"]))

    def finish(self, *, attempt_id: int, token: str, outcome: str, summary: dict, error: str | None) -> str:
        answer = self._call(
            self.calls,
            "POST",
            f"attempts/{attempt_id}/finish",
            {"token": token, "outcome": outcome, "summary": summary, "error": error},
        )
        return answer["job_state"]

    def record(self, *, attempt_id: int, token: str, key: str, state: str, value: dict) -> Record:
        """On `calls`, like a finish (a value may be large). A write is safe to resend: `started`
        over the same attempt's `started` and `done` over `done` answer the same record."""
        answer = self._call(
            self.calls, "POST", f"attempts/{attempt_id}/records", {"token": token, "key": key, "state": state, "value": value}
        )
        return recordcheck.written(answer, key=key, state=state)

    def records(self, *, attempt_id: int, token: str) -> list[Record]:
        answer = self._call(self.calls, "POST", f"attempts/{attempt_id}/records/list", {"token": token})
        return recordcheck.listed(answer)

    def log_append(self, *, attempt_id: int, token: str, stream: str, offset: int, text: str, final: bool) -> LogState:
        """On `logs`. Safe to resend: a chunk within what the stream received adds nothing."""
        answer = self._call(
            self.logs, "POST", f"attempts/{attempt_id}/logs",
            {"token": token, "stream": stream, "offset": offset, "text": text, "final": final},
        )  # fmt: skip
        return log_state_of(answer, stream=stream)

    def status(self) -> dict:
        return self._call(self.calls, "GET", "status")

    def instance_logs(self, instance_id: int) -> dict:
        """`GET instances/{id}/logs`: every step log of an instance (for `apiary logs`)."""
        return self._call(self.calls, "GET", f"instances/{instance_id}/logs")

    def instance_log_text(self, instance_id: int, attempt_number: int, step: str, offset: int) -> dict:
        """`GET instances/{id}/logs/{attempt}/{step}/{offset}`: a step's log from `offset`."""
        return self._call(self.calls, "GET", f"instances/{instance_id}/logs/{attempt_number}/{step}/{offset}")

    def close(self) -> None:
        """Job threads call this when they end; the sessions stay for the others."""


def log_state_of(answer, *, stream: str) -> LogState:
    """The stream of a `POST attempts/{id}/logs` answer, every field checked; InvalidRequest otherwise."""
    def number(name):
        value = answer.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOG_OFFSET:
            raise InvalidRequest(f"POST logs: the control plane's answer is refused: {name} is not a stream offset")
        return value

    if not isinstance(answer, dict) or answer.get("stream") != stream:
        raise InvalidRequest("POST logs: the control plane's answer is refused: it is not this stream's")
    received, dropped = number("received"), number("dropped")
    if dropped > received or not isinstance(answer.get("ended"), bool) or not isinstance(answer.get("stored"), bool):
        raise InvalidRequest("POST logs: the control plane's answer is refused: dropped, ended or stored is wrong")
    return LogState(stream, received, dropped, answer["ended"], answer["stored"])

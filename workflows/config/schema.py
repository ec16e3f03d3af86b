"""The shape of apiary.yaml: the frozen values a loaded config is made of,
and the keys each section accepts.

Frozen because one `Config` is read by the control plane, the sources and the
embedded worker at once; none of them may change what the others see.
Reading a file into a `Config` is the other modules' job (`loading` first).
"""

import dataclasses
import ipaddress
from collections.abc import Mapping
from pathlib import Path

from jobqueue import conf
from jobqueue.types import Retry

SOURCE_TYPES = ("directory", "command")
ID_PATTERN = "[A-Za-z0-9][A-Za-z0-9._-]*"
MAX_ID_LENGTH = 128  # the queue's CharField width for ids used as limit keys

# The lease timings and attempt count default to jobqueue.conf's, so each number is written once.
_QUEUE_DEFAULTS = conf.QueueConfig()


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    id: str
    runner: str  # codex | claude | shell
    adapter: str  # codex-cli | claude-code | shell
    model: str | None = None
    # runner shell only: a string runs under `sh -c`, a tuple is an argv.
    command: str | tuple[str, ...] | None = None
    worker_pool: str | None = None
    requires_labels: tuple[str, ...] = ()
    requires_capabilities: tuple[str, ...] = ()
    workspace_affinity: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    id: str
    prompt: str | None = None  # exactly one of prompt / run is set
    run: str | None = None
    timeout: float | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    continue_on_error: bool = False
    publish: bool = False  # an external effect: succeeds at most once per instance (run steps only)
    spawn: bool = False  # stdout JSON lines become child tasks, once (run steps only)


# A workflow's `hooks` keys, each with the terminal job state (the outcome) it runs for.
HOOK_KEYS = {"on_success": "succeeded", "on_failure": "failed", "on_cancel": "cancelled"}


@dataclasses.dataclass(frozen=True)
class WorkflowConfig:
    id: str
    agent: str
    steps: tuple[StepConfig, ...]
    timeout: float | None = None
    retry: Retry = Retry()  # the queue's boundary type, so the policy and its defaults are defined once
    priority: int = 0
    # {terminal job state (succeeded | failed | cancelled): the run steps of its hook, in order}, for the
    # `hooks` keys given (HOOK_KEYS); keyed by the job state, the name the queue and the hook job use.
    hooks: Mapping[str, tuple[StepConfig, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    id: str
    type: str  # directory | command
    workflows: tuple[str, ...]
    poll_interval: float = 30.0
    path: Path | None = None  # directory: absolute, resolved against the config file's folder
    pattern: str = "*"
    redispatch_on_change: bool = False
    command: str | tuple[str, ...] | None = None  # command: string -> sh -c, tuple -> argv


@dataclasses.dataclass(frozen=True)
class ListenerSettings:
    """settings.queue.listener: how the worker protocol's listener is run."""

    processes: int = 2  # gunicorn processes, each an event loop serving any number of connections
    request_timeout: float = 10.0  # a request must arrive whole this soon, or its socket is closed
    idle_timeout: float = 60.0  # a kept-alive socket with no request for this long is closed


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    """settings.queue.tls: TLS is terminated by a proxy in front of the listener."""

    proxy_header: str  # the header the proxy sets to "https" (and strips from clients), e.g. X-Forwarded-Proto
    hsts_seconds: int = 31536000
    hsts_include_subdomains: bool = False
    hsts_preload: bool = False


def listen_host(listen: str) -> str:
    """The host part of `host:port`, without an IPv6 address's brackets."""
    return listen.rpartition(":")[0].strip("[]")


def is_loopback(listen: str) -> bool:
    """Whether `host:port` binds only this machine's loopback interface."""
    host = listen_host(listen)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, it is not known to be loopback


@dataclasses.dataclass(frozen=True)
class QueueSettings:
    listen: str | None = None
    worker_token: str | None = None
    previous_worker_tokens: tuple[str, ...] = ()  # still accepted during a rotation, logged as old
    enrollment: bool = _QUEUE_DEFAULTS.enrollment
    claim_rate: float = _QUEUE_DEFAULTS.claim_rate
    forget_workers_after: float = _QUEUE_DEFAULTS.forget_workers_after
    allowed_hosts: tuple[str, ...] = ()  # Host headers served besides the listen address's own (Django patterns)
    tls: TlsSettings | None = None
    embedded_worker: bool = True
    lease_duration: float = _QUEUE_DEFAULTS.lease_duration
    heartbeat_interval: float = _QUEUE_DEFAULTS.heartbeat_interval
    worker_timeout: float = _QUEUE_DEFAULTS.worker_timeout
    max_attempts: int = _QUEUE_DEFAULTS.max_attempts
    limits: conf.Limits = dataclasses.field(default_factory=conf.Limits)
    listener: ListenerSettings = ListenerSettings()


@dataclasses.dataclass(frozen=True)
class AdminSettings:
    """settings.admin: the admin and dashboard on an address of their own, without the worker
    protocol (local mode's UI; beside settings.queue.listen, a loopback-only admin)."""

    listen: str | None = None


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    """settings.metrics: who may scrape /metrics, and where the daemon serves it itself."""

    listen: str | None = None  # host:port of the daemon's own /metrics and /healthz (local mode, or beside the listener)
    token: str | None = None  # a scraper's bearer token; without one only loopback clients (and no proxy) are answered


LOG_FORMATS = ("plain", "json")


@dataclasses.dataclass(frozen=True)
class Settings:
    concurrency: int = 0  # the project limit unless queue.concurrency.default_project is set; 0 = none
    worker_capacity: int = 1
    queue: QueueSettings = QueueSettings()
    metrics: MetricsSettings = MetricsSettings()
    log_format: str = "plain"  # $APIARY_LOG_FORMAT, when set, wins
    admin: AdminSettings = AdminSettings()


@dataclasses.dataclass(frozen=True)
class Config:
    path: Path
    project: str
    settings: Settings = Settings()
    agents: dict[str, AgentConfig] = dataclasses.field(default_factory=dict)
    workflows: dict[str, WorkflowConfig] = dataclasses.field(default_factory=dict)
    sources: dict[str, SourceConfig] = dataclasses.field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def state_dir(self) -> Path:
        return self.path.parent / ".apiary"

    def queue_config(self) -> conf.QueueConfig:
        q = self.settings.queue
        return conf.QueueConfig(
            lease_duration=q.lease_duration,
            heartbeat_interval=q.heartbeat_interval,
            worker_timeout=q.worker_timeout,
            max_attempts=q.max_attempts,
            limits=q.limits,
            enrollment=q.enrollment,
            claim_rate=q.claim_rate,
            claim_burst=max(1, round(2 * q.claim_rate)),
            forget_workers_after=q.forget_workers_after,
        )


# The keys each section accepts: anything else is reported as unknown, with a
# did-you-mean, rather than silently ignored.
TOP_KEYS = ("project", "settings", "agents", "workflows", "sources")
SETTINGS_KEYS = ("concurrency", "worker_capacity", "queue", "metrics", "log_format", "admin")
METRICS_KEYS = ("listen", "token")
ADMIN_KEYS = ("listen",)
QUEUE_KEYS = (
    "listen",
    "worker_token",
    "previous_worker_tokens",
    "enrollment",
    "claim_rate",
    "forget_workers_after",
    "embedded_worker",
    "lease_duration",
    "heartbeat_interval",
    "worker_timeout",
    "max_attempts",
    "concurrency",
    "listener",
    "allowed_hosts",
    "tls",
)
TLS_KEYS = ("proxy_header", "hsts_seconds", "hsts_include_subdomains", "hsts_preload")
LISTENER_KEYS = ("processes", "request_timeout", "idle_timeout")
CONCURRENCY_KEYS = tuple(f"default_{d}" for d in conf.DIMENSIONS) + tuple(conf.PLURAL[d] for d in conf.DIMENSIONS)
AGENT_KEYS = (
    "id",
    "runner",
    "model",
    "command",
    "worker_pool",
    "requires_labels",
    "requires_capabilities",
    "workspace_affinity",
    "env",
)
WORKFLOW_KEYS = ("id", "agent", "steps", "timeout", "retry", "priority", "hooks")
STEP_KEYS = ("id", "prompt", "run", "timeout", "env", "continue_on_error", "publish", "spawn")
HOOK_STEP_KEYS = ("id", "run", "timeout", "env")
RETRY_KEYS = ("max_attempts", "backoff", "backoff_max")
SOURCE_KEYS = ("id", "type", "workflows", "poll_interval", "path", "pattern", "redispatch_on_change", "command")
# Keys that belong to one source type: given on a source of the other type, they are an error.
_SOURCE_TYPE_KEYS = {"directory": ("path", "pattern", "redispatch_on_change"), "command": ("command",)}

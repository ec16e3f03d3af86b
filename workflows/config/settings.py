"""The `settings` section: concurrency, worker capacity and `settings.queue`
(listen address, worker token, lease timings and the concurrency limits).

Besides reading each key, this is where values are checked against each
other (heartbeat below the lease, worker timeout above the heartbeat) and
where limits naming an agent, source or pool that does not exist are
flagged, which is why it gets the already-built agents and sources.
"""

from collections.abc import Iterable, Mapping
from typing import Any

from jobqueue import conf
from jobqueue.types import CREDENTIAL_PREFIX, MAX_CAPACITY
from workflows.runners import ADAPTER_OF

from .checker import _BAD, _Checker, _default, _describe, _one_of, _seconds
from .schema import (
    ADMIN_KEYS,
    CONCURRENCY_KEYS,
    LISTENER_KEYS,
    LOG_FORMATS,
    METRICS_KEYS,
    QUEUE_KEYS,
    SETTINGS_KEYS,
    TLS_KEYS,
    AdminSettings,
    AgentConfig,
    ListenerSettings,
    MetricsSettings,
    QueueSettings,
    Settings,
    SourceConfig,
    TlsSettings,
    is_loopback,
)

# A worker token guards every job's commands: this short, it is guessable.
MIN_TOKEN_LENGTH = 32

# What an absent settings.queue key means comes from jobqueue.conf, not from here.
_QUEUE_DEFAULTS = conf.QueueConfig()


def _settings(
    check: _Checker, raw: Any, *, project: str, agents: Mapping[str, AgentConfig], sources: Mapping[str, SourceConfig]
) -> Settings:
    section = check.mapping(raw, "settings", SETTINGS_KEYS) or {}
    # Absent, like every other limit, means none: the workers' capacity governs.
    concurrency = _default(check.integer(section.get("concurrency"), "settings.concurrency", minimum=0), 0)
    capacity = check.integer(section.get("worker_capacity"), "settings.worker_capacity", minimum=1, maximum=MAX_CAPACITY)
    capacity = _default(capacity, 1)
    queue = _queue(
        check, section.get("queue"), concurrency=concurrency, project=project, agents=agents, sources=sources
    )
    metrics = _metrics(check, section.get("metrics"), queue=queue)
    log_format = _default(check.choice(section.get("log_format"), "settings.log_format", LOG_FORMATS), "plain")
    admin = _admin(check, section.get("admin"), queue_listen=queue.listen, tls=queue.tls is not None)
    return Settings(
        concurrency=concurrency, worker_capacity=capacity, queue=queue, metrics=metrics, log_format=log_format, admin=admin
    )


def _metrics(check: _Checker, raw: Any, *, queue: QueueSettings) -> MetricsSettings:
    """settings.metrics. Without a token /metrics answers loopback clients only,
    so an address other machines reach needs one; the token is a scraper's,
    never the worker token (whoever holds that can act as a worker)."""
    p = "settings.metrics"
    section = check.mapping(raw, p, METRICS_KEYS) or {}
    listen = check.string(section.get("listen"), f"{p}.listen", empty_is_absent=True)
    if listen is not None and not _valid_listen(listen):
        check.error(f"{p}.listen", f"expected host:port (such as 127.0.0.1:9464), got {listen!r}")
        listen = None
    token = check.string(section.get("token"), f"{p}.token", empty_is_absent=True)
    if token is not None:
        if len(token) < MIN_TOKEN_LENGTH:
            check.error(f"{p}.token", f"expected at least {MIN_TOKEN_LENGTH} random characters, got {len(token)}")
        elif token == queue.worker_token or token in queue.previous_worker_tokens:
            check.error(f"{p}.token", "is a worker token; give scrapers a token of their own")
    elif listen is not None and not is_loopback(listen) and f"{p}.token" not in check.failed:
        check.error(
            f"{p}.listen",
            f"{listen} is not loopback: set settings.metrics.token too (without it /metrics answers loopback clients only)",
        )
    return MetricsSettings(listen=listen, token=token)


def _admin(check: _Checker, raw: Any, *, queue_listen: str | None, tls: bool = False) -> AdminSettings:
    p = "settings.admin"
    section = check.mapping(raw, p, ADMIN_KEYS) or {}
    listen = check.string(section.get("listen"), f"{p}.listen", empty_is_absent=True)
    if listen is None:
        return AdminSettings()
    if not _valid_listen(listen):
        check.error(f"{p}.listen", f"expected host:port (such as 127.0.0.1:8000), got {listen!r}")
        return AdminSettings()
    if queue_listen is not None and _valid_listen(queue_listen) and listen.rpartition(":")[2] == queue_listen.rpartition(":")[2]:
        check.error(
            f"{p}.listen",
            f"port {listen.rpartition(':')[2]} is settings.queue.listen's, which serves the admin already; "
            "choose another port, or leave settings.admin.listen out",
        )
        return AdminSettings()
    if not is_loopback(listen):
        check.warn(
            f"{p}.listen",
            f"{listen} is not loopback: the admin's login travels in plain HTTP unless a TLS proxy is in front "
            "(settings.queue.tls)",
        )
    elif tls:
        check.warn(
            f"{p}.listen",
            "with settings.queue.tls every plain-HTTP request is redirected to https, this address's too: "
            "reach the admin through the TLS proxy in front of settings.queue.listen",
        )
    return AdminSettings(listen=listen)


def _queue(
    check: _Checker,
    raw: Any,
    *,
    concurrency: int,
    project: str,
    agents: Mapping[str, AgentConfig],
    sources: Mapping[str, SourceConfig],
) -> QueueSettings:
    p = "settings.queue"
    section = check.mapping(raw, p, QUEUE_KEYS) or {}
    listen = check.string(section.get("listen"), f"{p}.listen", empty_is_absent=True)
    if listen is not None and not _valid_listen(listen):
        check.error(f"{p}.listen", f"expected host:port (such as 0.0.0.0:8080), got {listen!r}")
    token = check.string(section.get("worker_token"), f"{p}.worker_token", empty_is_absent=True)
    if listen is not None and token is None and f"{p}.worker_token" not in check.failed:
        check.error(f"{p}.worker_token", "required when settings.queue.listen is set (workers authenticate with it)")
    elif token is not None and len(token) < MIN_TOKEN_LENGTH:
        if listen is not None and _valid_listen(listen) and not is_loopback(listen):
            check.error(
                f"{p}.worker_token",
                f"only {len(token)} characters; a listener on {listen} (not loopback) needs a random token "
                f"of {MIN_TOKEN_LENGTH}+ characters (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')",
            )
        else:
            check.warn(f"{p}.worker_token", f"only {len(token)} characters; use a long random token ({MIN_TOKEN_LENGTH}+ characters)")
    if token is not None and token.startswith(CREDENTIAL_PREFIX):
        check.error(f"{p}.worker_token", f"starts with {CREDENTIAL_PREFIX!r}, the prefix of per-worker credentials; "
                    "choose a shared token that does not")
    previous = _previous_tokens(check, section.get("previous_worker_tokens"), current=token)
    enrollment = _default(check.boolean(section.get("enrollment"), f"{p}.enrollment"), _QUEUE_DEFAULTS.enrollment)
    claim_rate = check.number(section.get("claim_rate"), f"{p}.claim_rate", minimum=0)
    forget = check.duration(section.get("forget_workers_after"), f"{p}.forget_workers_after")
    embedded = _default(check.boolean(section.get("embedded_worker"), f"{p}.embedded_worker"), True)
    if not embedded and listen is None and f"{p}.listen" not in check.failed:
        check.warn(f"{p}.embedded_worker", "false and settings.queue.listen is not set: no worker can run any job")
    lease = check.duration(section.get("lease_duration"), f"{p}.lease_duration")
    heartbeat = check.duration(section.get("heartbeat_interval"), f"{p}.heartbeat_interval")
    timeout = check.duration(section.get("worker_timeout"), f"{p}.worker_timeout")
    # Cross-checks only between values that were read correctly (or defaulted).
    lease_ok = f"{p}.lease_duration" not in check.failed
    heartbeat_ok = f"{p}.heartbeat_interval" not in check.failed
    timeout_ok = f"{p}.worker_timeout" not in check.failed
    lease = _default(lease, _QUEUE_DEFAULTS.lease_duration)
    heartbeat = _default(heartbeat, _QUEUE_DEFAULTS.heartbeat_interval)
    timeout = _default(timeout, _QUEUE_DEFAULTS.worker_timeout)
    if lease_ok and heartbeat_ok:
        if heartbeat >= lease:
            heartbeat_ok = False  # the heartbeat is the value to fix; do not also blame worker_timeout
            check.error(
                f"{p}.heartbeat_interval",
                f"expected less than lease_duration ({_seconds(lease)}), got {_seconds(heartbeat)}; "
                "every lease would run out between two heartbeats",
            )
        elif heartbeat > lease / 2:
            check.warn(
                f"{p}.heartbeat_interval",
                f"{_seconds(heartbeat)} is more than half of lease_duration ({_seconds(lease)}); "
                "one late heartbeat loses the lease (a third of it or less is comfortable)",
            )
    if heartbeat_ok and timeout_ok and timeout <= heartbeat:
        check.error(
            f"{p}.worker_timeout",
            f"expected more than heartbeat_interval ({_seconds(heartbeat)}), got {_seconds(timeout)}; "
            "healthy workers would look stale",
        )
    max_attempts = check.integer(section.get("max_attempts"), f"{p}.max_attempts", minimum=1)
    max_attempts = _default(max_attempts, _QUEUE_DEFAULTS.max_attempts)
    limits = _limits(
        check, section.get("concurrency"), concurrency=concurrency, project=project, agents=agents, sources=sources
    )
    listener = _listener(check, section.get("listener"))
    allowed_hosts = _allowed_hosts(check, section.get("allowed_hosts"))
    tls = _tls(check, section.get("tls"))
    return QueueSettings(
        listener=listener,
        listen=listen,
        worker_token=token,
        previous_worker_tokens=previous,
        enrollment=enrollment,
        claim_rate=_default(claim_rate, _QUEUE_DEFAULTS.claim_rate),
        forget_workers_after=_default(forget, _QUEUE_DEFAULTS.forget_workers_after),
        allowed_hosts=allowed_hosts,
        tls=tls,
        embedded_worker=embedded,
        lease_duration=lease,
        heartbeat_interval=heartbeat,
        worker_timeout=timeout,
        max_attempts=max_attempts,
        limits=limits,
    )


def _previous_tokens(check: _Checker, raw: Any, *, current: str | None) -> tuple[str, ...]:
    """settings.queue.previous_worker_tokens: old shared tokens still accepted during a rotation.
    Errors name the position, never the value (it is a secret)."""
    p = "settings.queue.previous_worker_tokens"
    tokens: list[str] = []
    for item_path, item in check.items(raw, p, "old worker tokens"):
        text = check.string(item, item_path)
        if text is None:
            continue
        if text.startswith(CREDENTIAL_PREFIX):
            check.error(item_path, f"starts with {CREDENTIAL_PREFIX!r}, the prefix of per-worker credentials")
        elif len(text) < MIN_TOKEN_LENGTH:
            check.error(item_path, f"expected at least {MIN_TOKEN_LENGTH} characters, got {len(text)}")
        elif text == current:
            check.error(item_path, "is the current worker_token; list only the tokens it replaced")
        elif text not in tokens:
            tokens.append(text)
    if tokens and current is None and p not in check.failed:
        check.error(p, "set worker_token too: previous tokens are accepted alongside the current one")
    return tuple(tokens)


def _listener(check: _Checker, raw: Any) -> ListenerSettings:
    p = "settings.queue.listener"
    section = check.mapping(raw, p, LISTENER_KEYS) or {}
    defaults = ListenerSettings()
    processes = check.integer(section.get("processes"), f"{p}.processes", minimum=1, maximum=64)
    request = check.duration(section.get("request_timeout"), f"{p}.request_timeout")
    idle = check.duration(section.get("idle_timeout"), f"{p}.idle_timeout")
    return ListenerSettings(
        processes=_default(processes, defaults.processes),
        request_timeout=_default(request, defaults.request_timeout),
        idle_timeout=_default(idle, defaults.idle_timeout),
    )


def _allowed_hosts(check: _Checker, raw: Any) -> tuple[str, ...]:
    """Host names (Django's ALLOWED_HOSTS patterns: `apiary.example.com`,
    `.example.com` for it and its subdomains, `*` for any) the listener serves."""
    return check.strings(raw, "settings.queue.allowed_hosts", what="host name")


def _tls(check: _Checker, raw: Any) -> TlsSettings | None:
    p = "settings.queue.tls"
    section = check.mapping(raw, p, TLS_KEYS, required=("proxy_header",))
    if section is None:
        return None
    header = check.word(section.get("proxy_header"), f"{p}.proxy_header", what="an HTTP header name")
    if header is not None and not all(c.isalnum() or c == "-" for c in header):
        check.error(f"{p}.proxy_header", f"expected an HTTP header name such as X-Forwarded-Proto, got {header!r}")
        header = None
    seconds = check.integer(section.get("hsts_seconds"), f"{p}.hsts_seconds", minimum=0)
    subdomains = check.boolean(section.get("hsts_include_subdomains"), f"{p}.hsts_include_subdomains")
    preload = check.boolean(section.get("hsts_preload"), f"{p}.hsts_preload")
    if header is None:
        return None
    defaults = TlsSettings(proxy_header=header)
    return TlsSettings(
        proxy_header=header,
        hsts_seconds=_default(seconds, defaults.hsts_seconds),
        hsts_include_subdomains=_default(subdomains, defaults.hsts_include_subdomains),
        hsts_preload=_default(preload, defaults.hsts_preload),
    )


def _valid_listen(listen: str) -> bool:
    host, sep, port = listen.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535 and not any(c.isspace() for c in listen))


def _limits(
    check: _Checker,
    raw: Any,
    *,
    concurrency: int,
    project: str,
    agents: Mapping[str, AgentConfig],
    sources: Mapping[str, SourceConfig],
) -> conf.Limits:
    """Defaults and keyed overrides per dimension. The project default is
    `default_project` when given (even 0 = unlimited), else settings.concurrency
    (0 = unlimited when that is absent too); every other default is 0."""
    p = "settings.queue.concurrency"
    section = check.mapping(raw, p, CONCURRENCY_KEYS) or {}
    defaults: dict[str, int] = {}
    overrides: dict[str, dict[str, int]] = {}
    pools = {a.worker_pool for a in agents.values() if a.worker_pool}
    # Which keys can ever meet a job, per dimension (and the section they come
    # from): a limit on any other key never applies.
    reachable: dict[str, tuple[Iterable[str], str, str]] = {
        "project": ((project,), "the project is", ""),
        "agent": (agents, "agents are", "agents"),
        "source": (sources, "sources are", "sources"),
        "pool": (pools, "pools used by agents are", "agents"),
    }
    for dim in conf.DIMENSIONS:
        key = f"default_{dim}"
        value = check.integer(section.get(key), f"{p}.{key}", minimum=0)
        defaults[dim] = _default(value, concurrency if dim == "project" else 0)
        plural = conf.PLURAL[dim]
        keyed = section.get(plural)
        if keyed is None or keyed is _BAD:
            overrides[dim] = {}
            continue
        if not isinstance(keyed, dict):
            check.error(f"{p}.{plural}", f"expected a mapping of {dim} names to limits, got {_describe(keyed)}")
            overrides[dim] = {}
            continue
        overrides[dim] = {}
        for name, limit in keyed.items():
            item_path = f"{p}.{plural}.{name}"
            if dim == "runner":
                wanted = check.choice(name, item_path, ADAPTER_OF.values(), hint=ADAPTER_OF)
                if wanted is None:
                    continue
            elif check.word(name, item_path, what=f"a {dim} name") is None:
                continue
            number = check.integer(limit, item_path, minimum=0)
            if number is None:
                continue
            overrides[dim][name] = number
            if dim in reachable:
                known, label, origin = reachable[dim]
                known = tuple(known)
                if name not in known and origin not in check.incomplete:
                    listing = _one_of(known) if known else "none"
                    check.warn(item_path, f"no {dim} is called {name!r} ({label}: {listing}); this limit never applies")
    return conf.Limits(defaults=defaults, overrides=overrides)

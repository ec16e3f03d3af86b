"""What `settings.queue` decides about the web side: which Host headers the
listener serves, whether TLS (terminated by a proxy) makes cookies Secure and
turns on HSTS and the HTTPS redirect, and when the daemon refuses to start.

`django_settings` is a pure function of the config (tested as such);
`apply` puts its answer in force for this process — `bootstrap.apply` calls it
in every process, the listener's gunicorn processes included, before the
ASGI application (and so SecurityMiddleware) is built.
"""

import socket

from django.conf import settings

from workflows.config import QueueSettings, is_loopback, listen_host

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# The worker protocol is never redirected to https: a worker's token has
# crossed by the time a redirect could answer, and requests turns a redirected
# POST into a GET. Workers reach a TLS control plane by its https:// URL.
# Nor are /metrics (its bearer token has crossed too) and /healthz (a probe
# of the listener's own port speaks plain HTTP and reads the status only).
REDIRECT_EXEMPT = [r"^api/worker(?:/|$)", r"^metrics$", r"^healthz$"]


def machine_names() -> list[str]:
    """This machine's own names and the addresses they resolve to: the Host
    headers a listener on 0.0.0.0 or :: serves when no allowed_hosts is set."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except OSError:
            continue
        for family, *_, address in infos:
            names.add(f"[{address[0]}]" if family == socket.AF_INET6 else address[0])
    return sorted(n for n in names if n)


def allowed_hosts(queue: QueueSettings, admin_listen: str | None = None) -> list[str]:
    """Loopback names always (the daemon's own tools and a proxy on this
    machine use them), the listen addresses' hosts (settings.queue.listen and
    settings.admin.listen), `allowed_hosts`; on a wildcard listen without
    `allowed_hosts`, this machine's names."""
    hosts = list(LOOPBACK_HOSTS)
    for listen in (queue.listen, admin_listen):
        if not listen:
            continue
        host = listen_host(listen)
        if host in WILDCARD_HOSTS:
            if not queue.allowed_hosts:
                hosts += machine_names()
        elif not is_loopback(listen):
            hosts.append(f"[{host}]" if ":" in host else host)
    hosts += queue.allowed_hosts
    return list(dict.fromkeys(h.lower() for h in hosts))


def django_settings(queue: QueueSettings, admin_listen: str | None = None) -> dict:
    tls = queue.tls
    values = {
        "ALLOWED_HOSTS": allowed_hosts(queue, admin_listen),
        "SECURE_PROXY_SSL_HEADER": None,
        "SECURE_SSL_REDIRECT": False,
        "SECURE_REDIRECT_EXEMPT": REDIRECT_EXEMPT,
        "SECURE_HSTS_SECONDS": 0,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": False,
        "SECURE_HSTS_PRELOAD": False,
        "SESSION_COOKIE_SECURE": False,
        "CSRF_COOKIE_SECURE": False,
    }
    if tls is not None:
        values.update(
            SECURE_PROXY_SSL_HEADER=("HTTP_" + tls.proxy_header.upper().replace("-", "_"), "https"),
            SECURE_SSL_REDIRECT=True,
            SECURE_HSTS_SECONDS=tls.hsts_seconds,
            SECURE_HSTS_INCLUDE_SUBDOMAINS=tls.hsts_include_subdomains,
            SECURE_HSTS_PRELOAD=tls.hsts_preload,
            SESSION_COOKIE_SECURE=True,
            CSRF_COOKIE_SECURE=True,
        )
    return values


def apply(queue: QueueSettings, admin_listen: str | None = None) -> None:
    for name, value in django_settings(queue, admin_listen).items():
        setattr(settings, name, value)


def refusals(queue: QueueSettings, *, debug: bool, admin_listen: str | None = None) -> list[str]:
    """Why `apiary run` must not start with this config (empty: it may).
    The short-token refusal is a config error (workflows.config.settings)."""
    problems = []
    for key, listen in (("settings.queue.listen", queue.listen), ("settings.admin.listen", admin_listen)):
        if debug and listen and not is_loopback(listen):
            problems.append(
                f"APIARY_DEBUG=1 with {key} {listen} (not loopback): Django's debug pages "
                "show settings and source to anyone who can reach the listener; unset APIARY_DEBUG or listen on 127.0.0.1"
            )
    return problems


def client_ip(request) -> str | None:
    """The login throttle's client address (AXES_CLIENT_IP_CALLABLE). Behind
    the TLS proxy of settings.queue.tls every request comes from the proxy, so
    the right-most X-Forwarded-For entry — the one the proxy itself appended,
    which a client cannot forge — is the client; without TLS, REMOTE_ADDR."""
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if settings.SECURE_PROXY_SSL_HEADER and forwarded.strip():
        return forwarded.rsplit(",", 1)[-1].strip()
    return request.META.get("REMOTE_ADDR")

"""The ASGI application the listener serves: the worker protocol
(jobqueue.api.asgi, where a waiting long-poll holds no thread) in front of
Django's handler, which serves the admin. Each process starts its wake-up
watcher before it serves anything.

The protocol is served only on the socket of settings.queue.listen
($APIARY_PROTOCOL_BIND, set by apiary_site.listener); on any other socket the
listener binds (settings.admin.listen) a request under /api/worker is answered
404 before Django sees it, so an admin-only address never exposes the protocol.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")

django_application = get_asgi_application()

from jobqueue.api.asgi import PREFIX, with_worker_protocol  # noqa: E402 - needs the apps loaded
from jobqueue.wakeup import watch  # noqa: E402


def protocol_port() -> int | None:
    """The port whose socket serves the worker protocol; None when none does. Unset (a test's
    own server, an older launcher): every socket does, as before settings.admin.listen."""
    bind = os.environ.get("APIARY_PROTOCOL_BIND")
    if bind is None:
        return -1
    port = bind.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def admin_only_elsewhere(protocol_app, port: int | None):
    """`protocol_app`, but requests under /api/worker on a socket other than `port`'s get a 404."""
    if port == -1:
        return protocol_app

    async def application(scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            server = scope.get("server") or (None, None)
            if port is None or server[1] != port:
                await send({"type": "http.response.start", "status": 404,
                            "headers": [(b"content-type", b"text/plain; charset=utf-8")]})  # fmt: skip
                await send({"type": "http.response.body", "body": b"Not Found\n"})
                return
        await protocol_app(scope, receive, send)

    return application


application = admin_only_elsewhere(with_worker_protocol(django_application), protocol_port())
watch.ensure_running().wait(10)

"""The daemon's own /metrics and /healthz, on settings.metrics.listen.

In local mode there is no listener, so `apiary run` serves the two answers
of apiary_site.monitoring itself: a small threaded WSGI server in the daemon
process, serving nothing else (no admin, no worker protocol). Its metric
files are the ones the listener reads too, so both addresses answer alike.
"""

import json
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from django.db import connections
from prometheus_client.exposition import ThreadingWSGIServer

from workflows.config import listen_host

from . import monitoring

READ_TIMEOUT = 10.0  # seconds a client may take to send its request before its socket is closed


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's name
        pass  # a scrape every few seconds is no news


def application(environ, start_response):
    try:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            status, headers, body = 405, {"Content-Type": "text/plain; charset=utf-8", "Allow": "GET, HEAD"}, b"GET only\n"
        elif path == "/metrics":
            status, headers, body = monitoring.metrics_answer(
                environ.get("HTTP_AUTHORIZATION"), environ.get("REMOTE_ADDR"), behind_proxy=False,
                accept=environ.get("HTTP_ACCEPT"),
            )
        elif path == "/healthz":
            status, document = monitoring.health()
            headers, body = {"Content-Type": "application/json"}, json.dumps(document).encode()
        else:
            status, headers, body = 404, {"Content-Type": "text/plain; charset=utf-8"}, b"/metrics and /healthz only\n"
    finally:
        connections.close_all()  # this request thread's own connection
    reason = {200: "OK", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
    start_response(f"{status} {reason.get(status, '')}", [*headers.items(), ("Cache-Control", "no-store")])
    return [b"" if method == "HEAD" else body]


class MonitorServer:
    def __init__(self, listen: str):
        host, port = listen_host(listen), int(listen.rpartition(":")[2])
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        class Server(ThreadingWSGIServer):
            address_family = family

        self.httpd = make_server(host, port, application, server_class=Server, handler_class=_Quiet)
        self.address = self.httpd.server_address
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="monitor-server", daemon=True)

    def start(self) -> "MonitorServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

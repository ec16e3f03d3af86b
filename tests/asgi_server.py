"""The listener's ASGI application (Django behind jobqueue.api.asgi), served
by uvicorn with the listener's own HTTP protocol (request deadlines) on a
thread of the test process, so it shares the test database, the injected
clock and the settings the test sets — the ASGI counterpart of
pytest-django's `live_server`."""

import asyncio
import socket
import threading

import uvicorn
from django.core.handlers.asgi import ASGIHandler
from django.db import connections

from apiary_site.listener import ApiaryHttp
from jobqueue import longpoll
from jobqueue.api import asgi
from jobqueue.api.asgi import with_worker_protocol


class AsgiServer:
    def __init__(self, *, request_timeout: float = 10.0, idle_timeout: float = 5):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

        class Protocol(ApiaryHttp):
            pass

        Protocol.request_timeout = request_timeout
        config = uvicorn.Config(
            with_worker_protocol(ASGIHandler()), http=Protocol, lifespan="off", log_level="warning",
            timeout_keep_alive=idle_timeout,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="asgi-test-server", daemon=True)

    def _run(self):
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self):
        # Under the listener connections close after each call (CONN_MAX_AGE 0 under
        # ASGI); here too, so none is left open when the test database is dropped.
        self.released = asgi._release, longpoll._release
        asgi._release = longpoll._release = connections.close_all
        self.thread.start()
        deadline = threading.Event()
        for _ in range(500):
            if self.server.started:
                return self
            deadline.wait(0.01)
        raise RuntimeError("the ASGI test server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        asgi._release, longpoll._release = self.released

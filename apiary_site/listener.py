"""The worker protocol's HTTP listener: gunicorn, through its application API.

`apiary run` starts this module as a child process (`python -m
apiary_site.listener --bind HOST:PORT …`) when `settings.queue.listen` is
set, and with `--admin-bind HOST:PORT` when `settings.admin.listen` is: that
address serves the admin and dashboard only — the worker protocol answers 404
there (apiary_site.asgi), so local mode gets a UI without exposing the protocol. A child, not threads in the daemon: gunicorn's arbiter owns its
process's signals and forks workers, which must not happen in a process
that already runs the control plane's threads.

Each gunicorn process runs uvicorn (ASGI) with an event loop: a waiting
long-poll is a coroutine (jobqueue.api.asgi), so a thousand of them cost
memory, not threads, and heartbeats and finishes never queue behind them;
those run as Django sync views in a pool of threads that only ever wait on
the database. The protocol
(`ApiaryHttp`) adds what uvicorn lacks against slow or idle sockets: a
client must send a whole request — headers and body — within
`request_timeout` of connecting or of its previous answer, or the socket is
closed; a kept-alive socket idle for `idle_timeout` is closed too.
"""

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from gunicorn.app.base import BaseApplication
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker

from workflows.config import is_loopback
from workflows.config.schema import ListenerSettings as ListenerOptions  # settings.queue.listener

DEFAULTS = ListenerOptions()


class ApiaryHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request to arrive whole."""

    request_timeout = DEFAULTS.request_timeout

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arrival = self.loop.call_later(self.request_timeout, self._too_slow)

    def on_message_begin(self):
        super().on_message_begin()
        self._whole = False

    def on_message_complete(self):
        super().on_message_complete()
        self._whole = True
        if self.cycle is None or not self.cycle.response_complete:
            self._stop_clock()  # being answered: a long-poll may take its time
        # else answered before its body was read (a 401): the clock set at that
        # answer runs on, or nothing would ever close this socket.

    def on_response_complete(self):
        super().on_response_complete()  # arms uvicorn's idle (keep-alive) timer
        if not self.transport.is_closing():
            self._stop_clock()
            self._arrival = self.loop.call_later(self.request_timeout + self.timeout_keep_alive, self._too_slow)

    def connection_lost(self, exc):
        self._stop_clock()
        super().connection_lost(exc)

    def _stop_clock(self):
        arrival = getattr(self, "_arrival", None)
        if arrival is not None:
            arrival.cancel()
            self._arrival = None

    def _too_slow(self):
        self._arrival = None
        # Not while a whole request is being answered (a pipelined one): only a request still arriving.
        busy = getattr(self, "_whole", False) and self.cycle is not None and not self.cycle.response_complete
        if not self.transport.is_closing() and not busy:
            self.transport.close()


class ApiaryWorker(UvicornWorker):
    CONFIG_KWARGS = {"loop": "asyncio", "http": ApiaryHttp, "lifespan": "off"}


class ListenerApplication(BaseApplication):
    def __init__(self, options: dict):
        self.options = options
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
        import django

        django.setup()
        from apiary_site import bootstrap

        bootstrap.configure(os.environ.get("APIARY_CONFIG"))
        from apiary_site.asgi import application

        return application


def options_for(bind: str | list[str], listener: ListenerOptions = DEFAULTS) -> dict:
    ApiaryHttp.request_timeout = listener.request_timeout  # the class uvicorn instantiates per connection
    return {
        "bind": bind,
        # $APIARY_HTTP_WORKERS overrides the config (benchmarks compare process counts with it).
        "workers": int(os.environ.get("APIARY_HTTP_WORKERS", listener.processes)),
        "worker_class": "apiary_site.listener.ApiaryWorker",
        "timeout": 60,
        "graceful_timeout": 10,
        "keepalive": max(1, round(listener.idle_timeout)),  # gunicorn takes whole seconds
        "backlog": 2048,
        # Access logs would be the only place a request line shows; the token
        # travels in a header and gunicorn's default access format has no headers.
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "proc_name": "apiary-listener",
    }


def start(
    bind: str | None, *, config_path: str, listener: ListenerOptions = DEFAULTS, admin_bind: str | None = None
) -> subprocess.Popen:
    """Start the listener as a child process of the daemon: the worker protocol (and the
    admin) on `bind`, the admin alone on `admin_bind`; either may be None, not both."""
    if not bind and not admin_bind:
        raise ValueError("a listener needs an address: bind or admin_bind")
    env = {**os.environ, "APIARY_CONFIG": config_path, "APIARY_ASGI": "1"}
    where = [*(["--bind", bind] if bind else []), *(["--admin-bind", admin_bind] if admin_bind else [])]
    argv = [
        sys.executable, "-m", "apiary_site.listener", *where, "--parent", str(os.getpid()),
        "--processes", str(listener.processes),
        "--request-timeout", str(listener.request_timeout),
        "--idle-timeout", str(listener.idle_timeout),
    ]  # fmt: skip
    return subprocess.Popen(argv, env=env)


def exit_with_parent(parent: int, *, interval: float = 0.5) -> threading.Thread:
    """Stop gracefully (SIGTERM to ourselves) once `parent` is no longer our
    parent. A SIGKILLed daemon cannot stop its listener: the orphan would keep
    serving the protocol with no reaper behind it, and hold the port so the
    restarted daemon could not bind it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _metrics_dir() -> None:
    """The directory where this listener's processes keep their metrics
    (jobqueue.metrics), merged by whichever process answers a scrape. `apiary
    run` passes its own (.apiary/metrics, shared with the daemon); a listener
    started on its own gets a fresh one, removed when it stops. Set here,
    before anything imports prometheus-client and before gunicorn forks."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    directory = tempfile.mkdtemp(prefix="apiary-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    arbiter = os.getpid()
    atexit.register(lambda: os.getpid() == arbiter and shutil.rmtree(directory, ignore_errors=True))


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the Apiary worker protocol with gunicorn.")
    parser.add_argument("--bind", help="HOST:PORT serving the worker protocol and the admin")
    parser.add_argument("--admin-bind", help="HOST:PORT serving the admin only (the worker protocol answers 404)")
    parser.add_argument("--parent", type=int, help="pid of the daemon; the listener stops when it is gone")
    parser.add_argument("--processes", type=int, default=ListenerOptions.processes)
    parser.add_argument("--request-timeout", type=float, default=ListenerOptions.request_timeout)
    parser.add_argument("--idle-timeout", type=float, default=ListenerOptions.idle_timeout)
    args = parser.parse_args()
    binds = [b for b in (args.bind, args.admin_bind) if b]
    if not binds:
        parser.error("give --bind, --admin-bind or both")
    for bind in binds:
        if os.environ.get("APIARY_DEBUG") == "1" and not is_loopback(bind):  # as `apiary run` refuses it
            sys.exit(f"apiary listener: refusing APIARY_DEBUG=1 on {bind} (not loopback)")
    os.environ["APIARY_ASGI"] = "1"  # settings: no persistent connections, a pool on PostgreSQL
    _metrics_dir()
    # Which socket serves the worker protocol (apiary_site.asgi reads it in each process).
    os.environ["APIARY_PROTOCOL_BIND"] = args.bind or ""
    if args.parent:
        exit_with_parent(args.parent)  # in the arbiter only: forked workers do not inherit threads
    options = ListenerOptions(args.processes, args.request_timeout, args.idle_timeout)
    ListenerApplication(options_for(binds, options)).run()


if __name__ == "__main__":
    main()

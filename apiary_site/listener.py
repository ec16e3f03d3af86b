"""The worker protocol's HTTP listener: gunicorn, through its application API.

`apiary run` starts this module as a child process (`python -m
apiary_site.listener --bind HOST:PORT`) when `settings.queue.listen` is set.
A child, not threads in the daemon: gunicorn's arbiter owns its process's
signals and forks workers, which must not happen in a process that already
runs the control plane's threads. The gthread worker class serves long-poll
claims from a thread pool without tying up a process per waiting worker.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from gunicorn.app.base import BaseApplication


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
        from apiary_site.wsgi import application

        return application


def options_for(bind: str) -> dict:
    return {
        "bind": bind,
        "workers": int(os.environ.get("APIARY_HTTP_WORKERS", "2")),
        "worker_class": "gthread",
        # Each waiting long-poll holds a thread for up to 30 s.
        "threads": int(os.environ.get("APIARY_HTTP_THREADS", "16")),
        "timeout": 60,
        "graceful_timeout": 10,
        "keepalive": 30,
        # Access logs would be the only place a request line shows; the token
        # travels in a header and gunicorn's default access format has no headers.
        "accesslog": None,
        "errorlog": "-",
        "loglevel": "warning",
        "proc_name": "apiary-listener",
    }


def start(bind: str, *, config_path: str) -> subprocess.Popen:
    """Start the listener as a child process of the daemon."""
    env = {**os.environ, "APIARY_CONFIG": config_path}
    argv = [sys.executable, "-m", "apiary_site.listener", "--bind", bind, "--parent", str(os.getpid())]
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


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the Apiary worker protocol with gunicorn.")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--parent", type=int, help="pid of the daemon; the listener stops when it is gone")
    args = parser.parse_args()
    if args.parent:
        exit_with_parent(args.parent)  # in the arbiter only: forked workers do not inherit threads
    ListenerApplication(options_for(args.bind)).run()


if __name__ == "__main__":
    main()

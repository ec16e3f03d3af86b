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
import subprocess
import sys

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
    return subprocess.Popen([sys.executable, "-m", "apiary_site.listener", "--bind", bind], env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve the Apiary worker protocol with gunicorn.")
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()
    ListenerApplication(options_for(args.bind)).run()


if __name__ == "__main__":
    main()

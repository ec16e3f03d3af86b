"""`apiary run`: the control plane, with the embedded worker unless configured off."""

import argparse
import logging
import signal
import subprocess
import threading

from django.core.management.base import BaseCommand, CommandError

from apiary_site import bootstrap
from apiary_site import listener as apiary_listener
from jobqueue import services as queue
from jobqueue.exceptions import Unavailable
from workers.embedded import embedded_runtime
from workflows.controlplane import ControlPlane

log = logging.getLogger("apiary.controlplane")


class Command(BaseCommand):
    help = "Run the control plane: migrate, reconcile, poll sources, dispatch, reap leases, run the embedded worker."

    def add_arguments(self, parser):
        parser.add_argument("--config", help="path to apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")
        parser.add_argument(
            "--until-idle",
            action="store_true",
            help="exit 0 once every source has been polled and no job is queued or leased "
            "(exit 3 when the queued jobs left can never run, e.g. no worker in their pool)",
        )
        parser.add_argument("--tick", type=float, default=0.2, help=argparse.SUPPRESS)

    def handle(self, *args, **options):
        config = bootstrap.configure(options["config"])
        bootstrap.prepare_database(config)
        fixed = queue.reconcile()
        log.info(
            "control plane up: project %s, config %s; reconciled %d expired lease(s), %d instance(s), %d task(s)",
            config.project, config.path, fixed.expired, fixed.instances, fixed.tasks,
        )
        for warning in config.warnings:
            log.warning("config: %s", warning)

        listener = None
        queue_settings = config.settings.queue
        if queue_settings.listen:
            if not queue_settings.worker_token:
                raise CommandError(
                    "settings.queue.listen is set but settings.queue.worker_token is empty: "
                    "refusing to serve the worker protocol without a token",
                    returncode=2,
                )
            listener = apiary_listener.start(queue_settings.listen, config_path=str(config.path))
            log.info("worker protocol listening on %s (gunicorn, pid %s)", queue_settings.listen, listener.pid)

        control = ControlPlane(config=config)
        runtime = thread = None
        if config.settings.queue.embedded_worker:
            runtime = embedded_runtime(config)
            runtime.start()
            thread = threading.Thread(target=runtime.run, name="embedded-worker", daemon=True)
            thread.start()
        else:
            log.info("embedded worker off (settings.queue.embedded_worker: false): jobs wait for remote workers")

        stop = threading.Event()
        signals = {"count": 0, "acted": 0}

        # The handler only records the signal: it runs on the main thread between
        # any two bytecodes, possibly while that thread holds the runtime's lock.
        def on_signal(signum, frame):
            signals["count"] += 1
            stop.set()

        def act_on_signals() -> None:
            if signals["acted"] < 1 <= signals["count"]:
                signals["acted"] = 1
                log.info("signal: draining (a second signal stops running jobs)")
                if runtime:
                    runtime.request_drain("shutting down")
            if signals["acted"] < 2 <= signals["count"]:
                signals["acted"] = 2
                if runtime:
                    runtime.cancel_all("second signal")

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        exit_code = 0
        stuck_before: list[dict] = []
        try:
            while not stop.is_set():
                try:
                    control.run_once()
                except Unavailable as exc:
                    log.warning("database busy: %s", exc)
                if runtime and runtime.fatal:
                    exit_code = 1
                    break
                if listener and listener.poll() is not None:
                    log.error("the worker protocol listener exited with code %s; stopping", listener.returncode)
                    exit_code = 1
                    break
                if options["until_idle"] and control.polled >= set(config.sources) and (runtime is None or runtime.idle()):
                    if control.idle():
                        log.info("idle: every source polled, no job queued or leased")
                        for source_id in sorted(control.failed_sources()):
                            log.warning("source %s failed its last poll: its items may be missing", source_id)
                        break
                    stuck = control.stuck()
                    if stuck and stuck == stuck_before:  # the same verdict twice in a row, not a passing state
                        for job in stuck:
                            log.error("blocked: job %s: %s", job["job_id"], job["reason"])
                        log.error("--until-idle: %d queued job(s) can never run as configured; exiting 3", len(stuck))
                        exit_code = 3
                        break
                    stuck_before = stuck
                stop.wait(options["tick"])
            act_on_signals()
            if runtime:
                runtime.request_drain("shutting down")
                while thread.is_alive():  # a second signal during the drain stops the running jobs
                    thread.join(0.1)
                    act_on_signals()
        finally:
            if listener and listener.poll() is None:
                listener.terminate()  # gunicorn: graceful stop of its workers
                try:
                    listener.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    listener.kill()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if exit_code:
            raise SystemExit(exit_code)

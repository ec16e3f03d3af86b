"""`apiary run`: the control plane, with the embedded worker unless configured off."""

import argparse
import logging

from django.conf import settings
from django.core.checks import Tags
from django.core.checks.registry import registry
from django.core.management.base import CommandError

from apiary_site import bootstrap, monitoring, security
from apiary_site.management.base import ApiaryCommand
from apiary_site.monitorserver import MonitorServer
from apiary_site.statelock import StateLock, StateLocked
from jobqueue import metrics as queue_metrics
from jobqueue import services as queue
from workflows.controlplane import ControlPlane
from workflows.daemon import Daemon, embedded_runtime

log = logging.getLogger("apiary.controlplane")
LISTENER_CHECKS = {Tags.admin, Tags.templates, Tags.urls}  # what only the HTTP listener uses


class Command(ApiaryCommand):
    words = "run"
    help = "Run the control plane: migrate, reconcile, poll sources, dispatch, reap leases, run the embedded worker."

    def add_arguments(self, parser):
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")
        parser.add_argument(
            "--until-idle",
            action="store_true",
            help="exit 0 once every source has been polled and no job is queued or leased "
            "(exit 3 when the queued jobs left can never run, e.g. no worker in their pool)",
        )
        parser.add_argument("--tick", type=float, default=0.2, help=argparse.SUPPRESS)

    def check(self, *args, tags=None, **kwargs):
        """The system checks Django runs before `handle`, but not those of
        what only the listener serves: the URL checks import the whole URLconf
        (admin, DRF), the template and admin checks load every template tag
        library (DRF's imports psycopg), about half a second together, and
        this process serves no page: the listener is a child of its own.
        `handle` runs every check when it starts one. Untagged checks (axes'
        and auth's, about settings.py and the listener's middleware) cannot be
        selected by tag, so they run then too; `manage.py check` runs them all."""
        if tags is None:
            tags = {tag for check in registry.get_checks() for tag in check.tags} - LISTENER_CHECKS
        return super().check(*args, tags=tags, **kwargs)

    def handle(self, *args, **options):
        config = bootstrap.configure(options["config"])
        refusals = security.refusals(config.settings.queue, debug=settings.DEBUG, admin_listen=config.settings.admin.listen)
        if refusals:  # before anything starts: no state directory, no listener, no migration
            raise CommandError("; ".join(refusals), returncode=2)
        if (config.settings.queue.listen or config.settings.admin.listen) and not options["skip_checks"]:
            super().check()  # every check, the untagged ones too: what the listener will serve must load
        try:  # before anything else starts; held until the daemon has stopped
            lock = StateLock.acquire(config.state_dir)
        except StateLocked as exc:
            raise CommandError(str(exc)) from exc
        try:
            self._run(config, options)
        finally:
            lock.release()

    def _run(self, config, options):
        bootstrap.prepare_database(config)
        # Before anything records a metric or the listener starts (it inherits the directory).
        queue_metrics.enable_multiprocess(monitoring.reset_metrics_dir(config.state_dir))
        expired = queue.reconcile()
        log.info(
            "control plane up: project %s, config %s; reconciled %d expired lease(s)", config.project, config.path, expired
        )
        for warning in config.warnings:
            log.warning("config: %s", warning)

        listener = None
        queue_settings = config.settings.queue
        admin_listen = config.settings.admin.listen
        if queue_settings.listen and not queue_settings.worker_token:
            raise CommandError(
                "settings.queue.listen is set but settings.queue.worker_token is empty: "
                "refusing to serve the worker protocol without a token",
                returncode=2,
            )
        if queue_settings.listen or admin_listen:
            from apiary_site import listener as apiary_listener  # gunicorn, uvicorn: only when there is one

            listener = apiary_listener.start(
                queue_settings.listen, config_path=str(config.path), listener=queue_settings.listener,
                admin_bind=admin_listen,
            )  # fmt: skip
        if admin_listen:
            log.info("admin and dashboard on http://%s/admin/ (no worker protocol there)", admin_listen)
        if queue_settings.listen:
            log.info("worker protocol listening on %s (gunicorn + uvicorn, pid %s)", queue_settings.listen, listener.pid)
            log.info(
                "serving Host headers %s (add others to settings.queue.allowed_hosts); TLS %s",
                ", ".join(settings.ALLOWED_HOSTS),
                f"behind a proxy ({queue_settings.tls.proxy_header})" if queue_settings.tls else "not configured",
            )

        monitor = None
        if config.settings.metrics.listen:
            try:
                monitor = MonitorServer(config.settings.metrics.listen).start()
            except OSError as exc:
                if listener is not None:
                    listener.terminate()
                raise CommandError(f"settings.metrics.listen {config.settings.metrics.listen}: cannot listen: {exc}") from exc
            log.info("metrics and health on http://%s/metrics and /healthz", config.settings.metrics.listen)

        runtime = embedded_runtime(config) if queue_settings.embedded_worker else None
        daemon = Daemon(
            config=config,
            # Dispatch writes through the embedded worker's committer: one writer in this process.
            control=ControlPlane(config=config, committer=runtime.transport.committer if runtime else None),
            runtime=runtime,
            listener=listener,
            until_idle=options["until_idle"],
        )
        daemon.signals.install()
        try:
            exit_code = daemon.run(tick=options["tick"])
        finally:
            daemon.signals.restore()
            if monitor is not None:
                monitor.stop()
        if exit_code:
            raise SystemExit(exit_code)

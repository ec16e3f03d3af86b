"""Load apiary.yaml and put it in force for this process.

Every entry point that touches the queue (the daemon, the worker, the HTTP
listener's gunicorn processes, the operations commands) calls `configure`, so
lease durations, limits and the worker token are the same everywhere.
"""

import os
from pathlib import Path

from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from apiary_site import fresh_schema, logformat, security
from jobqueue import conf
from workers import private
from workflows.config import DEFAULT_CONFIG_NAME, Config, ConfigError, find_config_path, load


def configure(explicit_path: str | None = None, *, require_env: bool = True) -> Config:
    """Find, validate and apply the config; a CommandError (exit 2) lists every problem.
    `require_env=False`: unset `${VAR}`s leave their keys absent (workflows.config.load's unset_ok)."""
    try:
        config = load(find_config_path(explicit_path), unset_ok=() if require_env else ("",))
    except ConfigError as exc:
        raise CommandError(str(exc), returncode=2) from exc
    apply(config)
    return config


def configure_if_present(explicit_path: str | None = None, *, require_env: bool = True) -> Config | None:
    """`configure` when there is a config to read: a named one (an error if
    missing), else $APIARY_CONFIG, else ./apiary.yaml; None when there is none."""
    if explicit_path or os.environ.get("APIARY_CONFIG") or Path(DEFAULT_CONFIG_NAME).is_file():
        return configure(explicit_path, require_env=require_env)
    return None


def prepare_database(config: Config) -> None:
    """Create the state directory and bring the schema up to date (a no-op
    when it is): `apiary run` and `apiary task add` may come first on a new project.
    A new SQLite database is built from the schema's snapshot (apiary_site.fresh_schema),
    and migrated only if the tree has migrations that the snapshot lacks."""
    secure_state(config)
    if connection.vendor == "sqlite" and fresh_schema.build_if_new(connection):
        return
    call_command("migrate", interactive=False, verbosity=0)


def secure_state(config: Config) -> None:
    """`.apiary/` 0700; the SQLite database (made here, so its -wal and -shm
    follow), the secret key and the step logs 0600 — what exists already with
    wider modes is tightened, with a warning naming it."""
    state = private.private_dir(config.state_dir)
    private.tighten(state / "secret_key")
    if connection.vendor == "sqlite":
        private.private_sqlite(Path(connection.settings_dict["NAME"]))
    private.tighten_tree(state / "logs")
    private.tighten_tree(state / "workers")


def apply(config: Config) -> None:
    conf.configure(config.queue_config())
    settings.APIARY_WORKER_TOKEN = config.settings.queue.worker_token or ""
    settings.APIARY_PREVIOUS_WORKER_TOKENS = config.settings.queue.previous_worker_tokens
    security.apply(config.settings.queue, config.settings.admin.listen)
    settings.APIARY_METRICS = config.settings.metrics  # who may scrape /metrics (apiary_site.metrics)
    settings.APIARY_STATE = config.state_dir  # where /healthz finds the reaper's beat
    logformat.apply(config.settings.log_format)

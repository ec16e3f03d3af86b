"""What an operator command does in a project where `apiary run` never ran.

Two answers, chosen per command (each command's module says which and why):

* `ensure_database`: create the database, as `apiary run` would, and carry on.
  For commands where an empty queue is a fine place to start: the admin's
  first user (`apiary createsuperuser`, before the first `apiary run`), the
  first worker credentials, a status (an empty queue is the true answer), a
  task added by hand.
* `require_database`: one line saying there is no database yet and what
  creates it, and nothing created. For commands about one thing that can only
  exist once the control plane ran (cancel INSTANCE, affinity release TASK,
  worker drain ID): an empty database would only answer "no such thing", and
  would hide a wrong --config or a missing DATABASE_URL behind an empty queue.

Either way the config's `${VAR}`s need not be set (`require_env=False`):
these commands never use the listener's token or a step's secrets.
"""

from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection

from apiary_site import bootstrap
from apiary_site.management.inputs import queue_database
from workflows.config import Config


def database_exists() -> bool:
    """Whether the queue database exists and was migrated once, found without
    creating it (opening a SQLite path that is not there makes an empty file)."""
    with queue_database():  # an unreachable server: one line, not a traceback
        on_disk = connection.vendor == "sqlite" and not connection.is_in_memory_db()
        if on_disk and not Path(connection.settings_dict["NAME"]).is_file():
            return False
        return "django_migrations" in connection.introspection.table_names()


def where() -> str:
    return str(connection.settings_dict["NAME"]) if connection.vendor == "sqlite" else "in DATABASE_URL"


def require_database() -> None:
    if database_exists():
        return
    config = Path(settings.CONFIG_PATH)
    if config.is_file():
        raise CommandError(f"no queue database yet ({where()}): `apiary run --config {config}` creates it")
    raise CommandError(f"no queue database ({where()}) and no config at {config}: pass --config PATH")


def ensure_database(explicit_config: str | None) -> Config | None:
    """Put the project's config in force and create its database if it has
    none. With no config anywhere (no --config, $APIARY_CONFIG or
    ./apiary.yaml) nothing is created: the database must exist already (a
    DATABASE_URL, or a folder where `apiary run` ran)."""
    config = bootstrap.configure_if_present(explicit_config, require_env=False)
    if config is None:
        require_database()
    elif not database_exists():
        with queue_database():
            bootstrap.prepare_database(config)
    return config

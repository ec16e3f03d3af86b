"""What operator commands share about bad input: ids, and a queue database
they cannot use.

`positive_id` is the argparse type of a row id (`apiary cancel INSTANCE`,
`apiary affinity release TASK`): a whole number from 1 to 2**63 - 1, so a
negative or 30-digit id is a usage error (exit 2) instead of an integer the
database refuses. `queue_database()` turns a database that cannot be used (a
folder where `apiary run` never ran, an unreachable server) into a
CommandError saying so, never a traceback.
"""

import argparse
import contextlib
import getpass

from django.core.management.base import CommandError
from django.db import DatabaseError, connection

from jobqueue.exceptions import Unavailable
from workflows.selectors import instance_of

MAX_ID = 2**63 - 1  # a 64-bit primary key, on SQLite and PostgreSQL alike


def positive_id(text: str) -> int:
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_ID:
        raise argparse.ArgumentTypeError(f"expected an id (a whole number from 1 to {MAX_ID}), got {text!r}")
    return int(text)


@contextlib.contextmanager
def queue_database():
    try:
        yield
    except (DatabaseError, Unavailable) as exc:
        where = connection.settings_dict["NAME"]
        raise CommandError(f"cannot use the queue database {where} ({exc}); has `apiary run` run here?") from None


def cli_actor() -> str:
    """Who an operator command acts for, in the events it writes: `cli:<os user>`."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        import os

        return f"cli:uid {os.getuid()}"


def instance_arguments(parser) -> None:
    """The arguments of a command that acts on one workflow instance (cancel, retry)."""
    parser.add_argument("instance", type=positive_id, help="workflow instance id")
    parser.add_argument("--config", metavar="PATH", help="apiary.yaml (read by the apiary entry point)")


def instance_with_job(instance_id: int):
    """The workflow instance, its job loaded; CommandError when there is none (inside queue_database())."""
    instance = instance_of(instance_id=instance_id)
    if instance is None or instance.job is None:
        raise CommandError(f"no workflow instance {instance_id}")
    return instance

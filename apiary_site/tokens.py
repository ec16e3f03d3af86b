"""The worker token of `apiary worker` and `apiary status --control-plane`.

`--token-file PATH` or `$APIARY_WORKER_TOKEN` keep it out of `ps`; `--token T`
still works, with a warning, because every local user can read a command line.
"""

import os
import stat
from collections.abc import Callable

from django.core.management.base import CommandError

ENV = "APIARY_WORKER_TOKEN"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--token", metavar="T", help="worker token (visible in ps: prefer --token-file or $APIARY_WORKER_TOKEN)"
    )
    parser.add_argument("--token-file", metavar="PATH", help="file holding the worker token (mode 0600)")


def worker_token(*, token: str | None, token_file: str | None, warn: Callable[[str], object]) -> str:
    """The token from --token-file, --token or $APIARY_WORKER_TOKEN, in that
    order; "" when none is given. A file that cannot be read or holds nothing
    is an error (exit 2)."""
    if token and token_file:
        raise CommandError("pass --token or --token-file, not both", returncode=2)
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
                text = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise CommandError(f"--token-file {token_file}: cannot read it ({reason})", returncode=2) from exc
        if not text:
            raise CommandError(f"--token-file {token_file}: the file is empty", returncode=2)
        if mode & 0o077:
            warn(
                f"warning: --token-file {token_file} is readable by other users (mode {mode:04o}); chmod 600 {token_file}"
            )
        return text
    if token:
        warn(f"warning: --token puts the worker token in ps output for every local user; use --token-file or ${ENV}")
        return token
    return os.environ.get(ENV, "")

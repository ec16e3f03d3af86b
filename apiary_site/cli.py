"""The `apiary` console command: a thin router onto Django management commands.

`apiary run` is `manage.py runapiary`, `apiary check` is `checkconfig`
(Django owns `check`), `apiary worker drain ID` is `drainworker`, `apiary
worker undrain ID` is `undrainworker`, `apiary worker token …` is
`workertoken`, `apiary createsuperuser` is `apiarysuperuser` (Django's, after
creating the database: django.contrib.auth's command would shadow one of the
same name); every other word is passed to Django as is (`apiary migrate`,
`apiary affinity release TASK`, …). `apiary --version` is Apiary's version.

`--config` must be known before Django reads its settings (the database sits
beside the config file), so it is read here first and exported as
APIARY_CONFIG; the commands see the same value through their own `--config`.
"""

import os
import sys

from apiary_site import __version__

ALIASES = {"run": "runapiary", "check": "checkconfig", "createsuperuser": "apiarysuperuser"}
SUBCOMMANDS = {("worker", "drain"): "drainworker", ("worker", "undrain"): "undrainworker", ("worker", "token"): "workertoken"}

USAGE = """usage: apiary COMMAND [options]   (apiary COMMAND --help for its options)

  run [--config F] [--until-idle]      the control plane, embedded worker and listener
  check [--config F]                   validate apiary.yaml (exit 0 or 2)
  createsuperuser                      an admin login (creates the database if there is none yet)
  status [--json | --watch [--interval S]] [--control-plane URL --token-file F]
  worker --control-plane URL --token-file F --id ID [--pool P] [--label L]… [--capability C]… [--capacity N]
  worker drain ID | worker undrain ID
  worker token create ID | worker token revoke ID [--previous] | worker token list
  task add --source S --title T [--body B] [--workflow W]…
  cancel INSTANCE
  logs INSTANCE [--step S] [-f] [--control-plane URL --token-file F]
  retry INSTANCE                       queue a failed or cancelled instance again (a new attempt)
  affinity release TASK
  backup PATH                          a consistent copy of the SQLite database (0600)
  restore PATH                         replace it with a backup (refused while `apiary run` runs)

Django's own commands work too (apiary migrate, apiary changepassword, …;
apiary help --commands lists them). apiary --version prints Apiary's version.
"""


def _config_from_argv(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def route(argv: list[str]) -> list[str]:
    """Map `apiary WORDS…` to Django's `manage.py COMMAND ARGS…`."""
    args = list(argv[1:])
    if not args or args in (["help"], ["-h"], ["--help"]):
        return []
    if args[0] == "help" and not args[1].startswith("-"):  # `apiary help worker drain` is `apiary worker drain --help`
        return route([argv[0], *args[1:], "--help"])
    if tuple(args[:2]) in SUBCOMMANDS:
        return [argv[0], SUBCOMMANDS[tuple(args[:2])], *args[2:]]
    args[0] = ALIASES.get(args[0], args[0])
    return [argv[0], *args]


def main(argv: list[str] | None = None, prog_is_manage: bool = False) -> None:
    argv = list(sys.argv if argv is None else argv)
    config = _config_from_argv(argv)
    if config:
        os.environ["APIARY_CONFIG"] = os.path.abspath(config)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import DatabaseError

    if argv[1:] in (["--version"], ["version"]):  # Django's would print Django's version
        sys.stdout.write(f"apiary {__version__}\n")
        return
    routed = argv if prog_is_manage else route(argv)
    if not routed:
        sys.stdout.write(USAGE)
        return
    try:
        execute_from_command_line(routed)
    except ImproperlyConfigured as exc:  # settings refused the environment (DATABASE_URL): it says what
        if "--traceback" in routed:
            raise
        sys.stderr.write(f"apiary: {exc}\n")
        sys.exit(2)
    except DatabaseError as exc:
        # Apiary's commands say so themselves (apiary_site.management.firstrun); this is for Django's
        # (`apiary changepassword` before any migration): one line, unless a traceback was asked for.
        if "--traceback" in routed:
            raise
        sys.stderr.write(f"apiary: cannot use the database ({exc}); `apiary run` or `apiary migrate` creates it\n")
        sys.exit(1)

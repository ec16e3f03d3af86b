"""The `apiary` console command: a thin router onto Django management commands.

`apiary run` is `manage.py runapiary`, `apiary check` is `checkconfig`
(Django owns `check`), `apiary worker drain ID` is `drainworker`, `apiary worker token …` is `workertoken`,
`apiary affinity release TASK` is `affinity release TASK`; every other word is
passed to Django as is (`apiary migrate`, `apiary createsuperuser`, …).

`--config` must be known before Django reads its settings (the database sits
beside the config file), so it is read here first and exported as
APIARY_CONFIG; the commands see the same value through their own `--config`.
"""

import os
import sys

ALIASES = {"run": "runapiary", "check": "checkconfig"}

USAGE = """usage: apiary COMMAND [options]   (apiary COMMAND --help for its options)

  run [--config F] [--until-idle]      the control plane, embedded worker and listener
  check [--config F]                   validate apiary.yaml (exit 0 or 2)
  status [--json] [--control-plane URL --token-file F]
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

Django's own commands work too (apiary migrate, apiary createsuperuser, …;
apiary help --commands lists them).
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
    if args[:2] == ["worker", "drain"]:
        return [argv[0], "drainworker", *args[2:]]
    if args[:2] == ["worker", "undrain"]:
        return [argv[0], "drainworker", "--undo", *args[2:]]
    if args[:2] == ["worker", "token"]:
        return [argv[0], "workertoken", *args[2:]]
    args[0] = ALIASES.get(args[0], args[0])
    return [argv[0], *args]


def main(argv: list[str] | None = None, prog_is_manage: bool = False) -> None:
    argv = list(sys.argv if argv is None else argv)
    config = _config_from_argv(argv)
    if config:
        os.environ["APIARY_CONFIG"] = os.path.abspath(config)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    from django.core.management import execute_from_command_line

    routed = argv if prog_is_manage else route(argv)
    if not routed:
        sys.stdout.write(USAGE)
        return
    execute_from_command_line(routed)

"""What every Apiary command shares: its help speaks `apiary`.

Django builds each command's parser as `<prog> <command>` with its own flags
(--settings, --pythonpath, --traceback, -v, …). An Apiary user types `apiary
run` or `apiary worker drain`, never `manage.py runapiary`, and has no use for
Django's flags, so `ApiaryCommand` names the words the user typed in the usage
line and hides those flags from the help (they are still accepted: scripts and
`--traceback` while debugging keep working). `--version` is Apiary's.
"""

import argparse

from django.core.management.base import BaseCommand

from apiary_site import __version__

# Every option Django's BaseCommand.create_parser adds.
DJANGO_OPTIONS = frozenset(
    {"--version", "-v", "--verbosity", "--settings", "--pythonpath", "--traceback", "--no-color", "--force-color", "--skip-checks"}
)


def speak_apiary(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Hide Django's own options from `parser`'s usage and help."""
    for action in parser._actions:  # argparse has no public way to change an added option's help
        if DJANGO_OPTIONS.intersection(action.option_strings):
            action.help = argparse.SUPPRESS
    return parser


class ApiaryCommand(BaseCommand):
    # The words after `apiary` that run this command ("run", "worker drain"): its usage line.
    words = ""

    def get_version(self) -> str:
        return __version__

    def create_parser(self, prog_name, subcommand, **kwargs):
        return speak_apiary(super().create_parser("apiary", self.words or subcommand, **kwargs))

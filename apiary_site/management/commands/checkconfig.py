"""`apiary check`: validate apiary.yaml without touching the database.

Exit 0 with `OK: <path> (N sources, N workflows, N agents)` and any warnings
on stdout, or exit 2 with every error on stderr, one per line.
"""

import sys

from apiary_site.management.base import ApiaryCommand
from workflows.config import ConfigError, find_config_path, load


class Command(ApiaryCommand):
    words = "check"
    help = "Check apiary.yaml: print OK and warnings (exit 0) or every error (exit 2)."
    # A config check must work before any migration and without a database.
    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        try:
            config = load(find_config_path(options["config"]))
        except ConfigError as exc:
            for line in exc.errors:
                self.stderr.write(line)
            self.stderr.flush()
            # sys.exit rather than CommandError: call_command callers see the same exit code as the shell.
            sys.exit(2)
        self.stdout.write(
            f"OK: {config.path} ({len(config.sources)} sources, {len(config.workflows)} workflows, "
            f"{len(config.agents)} agents)"
        )
        for warning in config.warnings:
            self.stdout.write(f"warning: {warning}")

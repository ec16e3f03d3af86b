"""What every test child process (`python -m tests.…`) does first: parse its
arguments (with `--migrate`), set Django up on the database its environment
names (APIARY_DB_PATH or DATABASE_URL), and migrate it when asked."""

import argparse
import os


def django_child(parser: argparse.ArgumentParser) -> argparse.Namespace:
    parser.add_argument("--migrate", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apiary_site.settings")
    import django

    django.setup()
    if args.migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
    return args

"""`manage.py check`: Django's system checks, with apiary.yaml in force when
there is one, so `check --deploy` sees the listener's hosts, TLS, cookie and
HSTS settings as `apiary run` sets them (apiary_site.security)."""

from django.core.management.commands import check

from apiary_site import bootstrap


class Command(check.Command):
    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--config", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml, if any)")

    def handle(self, *app_labels, **options):
        bootstrap.configure_if_present(options["config"])
        return super().handle(*app_labels, **options)

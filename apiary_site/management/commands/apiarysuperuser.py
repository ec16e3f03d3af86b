"""`apiary createsuperuser`: Django's, in a project where `apiary run` may not have run yet.

The README's first steps are `apiary createsuperuser && apiary run`, so this
creates the database first when there is none (firstrun.ensure_database):
the admin's first user is what a new project starts with. `apiary` routes the
word here (apiary_site.cli): django.contrib.auth's command of the same name
comes first in INSTALLED_APPS and would shadow this one.
"""

from django.contrib.auth.management.commands import createsuperuser

from apiary_site.management import firstrun
from apiary_site.management.base import ApiaryCommand


class Command(ApiaryCommand, createsuperuser.Command):
    words = "createsuperuser"
    help = "Create an admin login (creating the queue database first if there is none yet)."
    # Django's check reads the migration table before handle() could create it; handle() migrates instead.
    requires_migrations_checks = False

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--config", metavar="PATH", help="apiary.yaml (default: $APIARY_CONFIG, then ./apiary.yaml)")

    def handle(self, *args, **options):
        firstrun.ensure_database(options["config"])
        return super().handle(*args, **options)

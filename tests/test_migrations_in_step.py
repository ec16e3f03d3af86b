"""Every model change has its migration: a model edited without one would
leave a database that `apiary run` migrates short of what the code expects."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_model_change_lacks_a_migration(capsys):
    try:
        call_command("makemigrations", "--check", "--dry-run", verbosity=1)
    except SystemExit as exc:  # --check exits 1 when a migration is missing
        pytest.fail(f"models changed without a migration:\n{capsys.readouterr().out}" if exc.code else "")

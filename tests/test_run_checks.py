"""`apiary run` runs Django's system checks before anything starts, but those
of what only the HTTP listener serves (URLs, templates, admin) and the untagged
ones only when it starts a listener: they import the URLconf, DRF and psycopg."""

import pytest
from django.core import checks
from django.core.checks.registry import registry
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from apiary_site import listener as apiary_listener
from apiary_site.management.commands import runapiary

TOKEN = "t" * 40


@pytest.fixture
def failing(settings, queue_config, monkeypatch):
    """Register a check that fails, with the given tags; a listener start would be a failure here."""
    settings.APIARY_WORKER_TOKEN = ""
    added = []

    def no_listener(*args, **kwargs):
        raise AssertionError("the listener was started")

    monkeypatch.setattr(apiary_listener, "start", no_listener)

    def register(*tags):
        def broken(app_configs=None, **kwargs):
            return [checks.Error("broken on purpose", id="tests.E001")]

        registry.register(broken, *tags)
        added.append(broken)

    yield register
    for check in added:
        registry.registered_checks.discard(check)


def project(tmp_path, settings_yaml: str = ""):
    path = tmp_path / "apiary.yaml"
    path.write_text("project: p\n" + settings_yaml)
    return str(path)


@pytest.mark.parametrize("tag", [checks.Tags.models, checks.Tags.security, checks.Tags.caches])
def test_a_failing_check_refuses_to_start_and_starts_nothing(tmp_path, failing, tag):
    failing(tag)
    with pytest.raises(SystemCheckError, match="tests.E001"):
        call_command("runapiary", config=project(tmp_path), skip_checks=False)
    assert not (tmp_path / ".apiary").exists()  # no state directory, no database, no lock


@pytest.mark.parametrize("tag", sorted(runapiary.LISTENER_CHECKS))
def test_the_listener_checks_are_not_run_at_start(failing, tag):
    failing(tag)
    runapiary.Command().check()  # what execute() runs before handle(): no error


@pytest.mark.parametrize(
    "listen",
    [
        f"settings:\n  queue:\n    listen: 127.0.0.1:8999\n    worker_token: {TOKEN}\n",
        "settings:\n  admin:\n    listen: 127.0.0.1:8999\n",
    ],
)
@pytest.mark.parametrize("tags", [(checks.Tags.urls,), ()], ids=["urls", "untagged"])
def test_with_a_listener_its_checks_refuse_to_start_and_start_nothing(tmp_path, failing, listen, tags):
    failing(*tags)
    with pytest.raises(SystemCheckError, match="tests.E001"):
        call_command("runapiary", config=project(tmp_path, listen), skip_checks=False)
    assert not (tmp_path / ".apiary").exists()

"""`apiary`'s help speaks Apiary: `--version` is Apiary's version, each
command's usage names the words the user typed (`apiary worker drain`, not
`manage.py drainworker`), Django's own flags are hidden from it (and still
accepted), and every option it shows says what it is for."""

import argparse
import pkgutil

import django
import pytest
from django.core.management import get_commands, load_command_class

import apiary_site
from apiary_site import cli
from apiary_site.management import commands
from apiary_site.management.base import DJANGO_OPTIONS, ApiaryCommand
from tests.daemon import apiary

WORDS = [
    "run", "check", "createsuperuser", "status", "worker", "worker drain", "worker undrain", "worker token",
    "task", "cancel", "affinity", "backup", "restore",
]
DJANGO_ONLY = {"check"}  # apiary_site's `check` is Django's system check with apiary.yaml applied (`manage.py check`)


def parser_of(words: str) -> argparse.ArgumentParser:
    routed = cli.route(["apiary", *words.split()])
    name = routed[1]
    command = load_command_class(get_commands()[name], name)
    return command.create_parser("apiary", name)


def test_apiary_version_is_apiarys_not_djangos(tmp_path):
    result = apiary("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"apiary {apiary_site.__version__}\n"
    assert django.get_version() not in result.stdout


def test_a_commands_version_is_apiarys_too(tmp_path):
    result = apiary("run", "--version", cwd=tmp_path)
    assert result.stdout.strip() == apiary_site.__version__


def test_apiary_run_help_names_apiary_run_and_no_django_flag(tmp_path):
    result = apiary("run", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: apiary run [-h] [--config PATH] [--until-idle]\n")
    assert "runapiary" not in result.stdout
    for flag in DJANGO_OPTIONS:
        assert flag not in result.stdout.split(), flag


@pytest.mark.parametrize("words", WORDS)
def test_usage_names_the_apiary_words_and_hides_djangos_flags(words):
    text = parser_of(words).format_help()
    assert text.startswith(f"usage: apiary {words} "), text.splitlines()[0]
    shown = {token.strip("[],") for token in text.split()}
    assert not DJANGO_OPTIONS & shown, DJANGO_OPTIONS & shown


def _undocumented(parser: argparse.ArgumentParser) -> list:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):  # `apiary task add`'s options too
            for sub in action.choices.values():
                found += _undocumented(sub)
        elif action.help is None:
            found.append(f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}")
    return found


@pytest.mark.parametrize("words", WORDS)
def test_every_option_shown_has_a_help_text(words):
    assert not _undocumented(parser_of(words))


def test_worker_help_documents_routing_and_capacity():
    text = parser_of("worker").format_help()
    for option in ("--pool P", "--label L", "--capability C", "--capacity N", "--control-plane URL", "--id ID"):
        assert option in text


def test_subcommands_usage_names_them_too(tmp_path):
    result = apiary("task", "add", "--help", cwd=tmp_path)
    assert result.stdout.startswith("usage: apiary task add "), result.stdout


def test_apiary_help_words_is_their_help(tmp_path):
    result = apiary("help", "worker", "drain", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: apiary worker drain ")


def test_djangos_flags_are_still_accepted(tmp_path):
    (tmp_path / "apiary.yaml").write_text(
        "agents: [{id: sh, runner: shell, command: cat}]\n"
        "workflows: [{id: w, agent: sh, steps: [{id: s, run: 'true'}]}]\n"
        "sources: []\n"
    )
    result = apiary("check", "-v", "0", "--no-color", "--traceback", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK: ")


def test_every_apiary_command_shares_the_base():
    names = [m.name for m in pkgutil.iter_modules(commands.__path__)]
    for name in names:
        command = load_command_class("apiary_site", name)
        assert isinstance(command, ApiaryCommand) or name in DJANGO_ONLY, f"{name} is not an ApiaryCommand"

"""`--token-file PATH` (and $APIARY_WORKER_TOKEN) keep the worker token out of
`ps`: `apiary worker` and `apiary status --control-plane` read it stripped,
refuse a file that is empty or unreadable, warn when others may read it; and
`--token` still works but warns that every local user can see it."""

import io

import pytest
from django.core.management import CommandError, call_command

from apiary_site.management.commands import worker as worker_command
from workers import http

TOKEN = "canary-token-file-3b9d2e7f0a1c4d85"
ID = {"status": (), "worker": ("--id", "w1")}


class Sent(Exception):
    """Raised by the fake transport: the command got as far as connecting."""


class FakeTransport:
    def __init__(self, *, token, **kwargs):
        raise Sent(token)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.delenv("APIARY_WORKER_TOKEN", raising=False)
    monkeypatch.setattr(http, "HttpTransport", FakeTransport)
    monkeypatch.setattr(worker_command, "HttpTransport", FakeTransport)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    return path


def status(*args) -> tuple[str, str]:
    """Run `status --control-plane …`; (token the transport got, stderr)."""
    err = io.StringIO()
    with pytest.raises(Sent) as sent:
        call_command("status", "--control-plane", "http://cp:8080", *args, stderr=err, stdout=io.StringIO())
    return sent.value.args[0], err.getvalue()


def test_status_reads_the_token_file_stripped_and_says_nothing(token_file):
    assert status("--token-file", str(token_file)) == (TOKEN, "")


def test_the_worker_reads_the_token_file(token_file, tmp_path):
    config = tmp_path / "apiary.yaml"
    config.write_text("project: w\n")
    with pytest.raises(Sent) as sent:
        call_command(
            "worker", "--control-plane", "http://cp:8080", "--id", "w1", "--config", str(config),
            "--token-file", str(token_file), stderr=io.StringIO(),
        )  # fmt: skip
    assert sent.value.args[0] == TOKEN


@pytest.mark.parametrize("command", ["status", "worker"])
def test_an_empty_token_file_is_refused(tmp_path, command):
    empty = tmp_path / "token"
    empty.write_text(" \n")
    with pytest.raises(CommandError, match=f"--token-file {empty}: the file is empty") as caught:
        call_command(command, "--control-plane", "http://cp:8080", *ID[command], "--token-file", str(empty))
    assert caught.value.returncode == 2


@pytest.mark.parametrize("command", ["status", "worker"])
def test_an_unreadable_token_file_is_refused(tmp_path, command):
    missing = tmp_path / "nope"
    with pytest.raises(CommandError, match=rf"--token-file {missing}: cannot read it \(No such file or directory\)"):
        call_command(command, "--control-plane", "http://cp:8080", *ID[command], "--token-file", str(missing))


def test_a_token_file_others_can_read_is_used_with_a_warning(token_file):
    token_file.chmod(0o644)
    token, err = status("--token-file", str(token_file))
    assert token == TOKEN
    assert f"--token-file {token_file} is readable by other users (mode 0644); chmod 600 {token_file}" in err


def test_token_on_the_command_line_still_works_but_warns_about_ps():
    token, err = status("--token", TOKEN)
    assert token == TOKEN
    assert "--token puts the worker token in ps output" in err and TOKEN not in err


def test_the_environment_variable_is_read_silently(monkeypatch):
    monkeypatch.setenv("APIARY_WORKER_TOKEN", TOKEN)
    assert status() == (TOKEN, "")


def test_token_and_token_file_together_are_refused(token_file):
    with pytest.raises(CommandError, match="not both"):
        call_command("status", "--control-plane", "http://cp:8080", "--token", TOKEN, "--token-file", str(token_file))

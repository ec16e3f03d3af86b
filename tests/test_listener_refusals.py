"""A listener reachable from other machines is refused what is only safe on
loopback: Django's debug pages, a short worker token; and it serves only the
Host headers of its listen address and settings.queue.allowed_hosts."""

import subprocess
import sys
import textwrap

import pytest
import requests
from django.core.management import CommandError, call_command

from apiary_site import listener as apiary_listener
from apiary_site import security
from workflows import config as cfg
from workflows.config import QueueSettings

TOKEN = "t" * 40


def project(tmp_path, queue: str):
    path = tmp_path / "apiary.yaml"
    path.write_text("project: p\nsettings:\n  queue:\n" + textwrap.indent(textwrap.dedent(queue), "    "))
    return path


@pytest.fixture(autouse=True)
def undone(settings, queue_config, monkeypatch):
    """What `configure` puts in force (Django settings, queue settings) is undone after each test;
    a listener start would be a failure here."""
    settings.APIARY_WORKER_TOKEN = ""

    def no_listener(*args, **kwargs):
        raise AssertionError("the listener was started")

    monkeypatch.setattr(apiary_listener, "start", no_listener)


def test_debug_with_a_public_listener_refuses_to_start_and_starts_nothing(tmp_path, settings):
    settings.DEBUG = True
    config = project(tmp_path, f"listen: 0.0.0.0:8080\nworker_token: {TOKEN}\n")
    with pytest.raises(CommandError, match="APIARY_DEBUG=1 with settings.queue.listen 0.0.0.0:8080") as caught:
        call_command("runapiary", config=str(config))
    assert caught.value.returncode == 2
    assert not (tmp_path / ".apiary").exists()  # no state directory, no database, no lock


@pytest.mark.parametrize("listen", ["127.0.0.1:8080", "[::1]:8080", "localhost:8080", "127.0.0.5:1"])
def test_debug_on_loopback_is_allowed(listen):
    assert security.refusals(QueueSettings(listen=listen, worker_token=TOKEN), debug=True) == []


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "[::]:8080", "10.0.0.5:8080", "apiary.example.com:80"])
def test_debug_on_any_other_address_is_refused(listen):
    assert security.refusals(QueueSettings(listen=listen, worker_token=TOKEN), debug=True)


def test_a_short_token_on_a_public_listener_refuses_to_start(tmp_path):
    config = project(tmp_path, "listen: 0.0.0.0:8080\nworker_token: x\n")
    with pytest.raises(CommandError, match=r"settings\.queue\.worker_token: only 1 characters.*32\+") as caught:
        call_command("runapiary", config=str(config))
    assert caught.value.returncode == 2
    assert not (tmp_path / ".apiary").exists()


def test_a_short_token_on_loopback_is_a_warning(tmp_path):
    config = cfg.load(project(tmp_path, "listen: 127.0.0.1:8080\nworker_token: short\n"))
    assert config.settings.queue.worker_token == "short"
    assert any("worker_token: only 5 characters" in w for w in config.warnings)


def test_a_32_character_token_is_enough_anywhere(tmp_path):
    config = cfg.load(project(tmp_path, f"listen: 0.0.0.0:8080\nworker_token: {'k' * 32}\n"))
    assert config.warnings == ()


@pytest.mark.processes
def test_the_listener_itself_refuses_debug_on_a_public_address():
    proc = subprocess.run(
        [sys.executable, "-m", "apiary_site.listener", "--bind", "0.0.0.0:1"],
        env={"APIARY_DEBUG": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "refusing APIARY_DEBUG=1 on 0.0.0.0:1" in proc.stderr


# --------------------------------------------------------------------------- Host headers


def test_allowed_hosts_are_the_listen_host_loopback_and_the_setting():
    queue = QueueSettings(listen="10.0.0.5:8080", allowed_hosts=("apiary.example.com", ".corp.example"))
    assert security.allowed_hosts(queue) == [
        "localhost", "127.0.0.1", "[::1]", "10.0.0.5", "apiary.example.com", ".corp.example",
    ]  # fmt: skip


def test_a_wildcard_listen_serves_the_machines_names_unless_allowed_hosts_is_set(monkeypatch):
    monkeypatch.setattr(security, "machine_names", lambda: ["build-7", "build-7.lan", "192.168.1.7"])
    assert "*" not in security.allowed_hosts(QueueSettings(listen="0.0.0.0:8080"))
    assert security.allowed_hosts(QueueSettings(listen="[::]:8080"))[3:] == ["build-7", "build-7.lan", "192.168.1.7"]
    only = security.allowed_hosts(QueueSettings(listen="0.0.0.0:8080", allowed_hosts=("apiary.example.com",)))
    assert only == ["localhost", "127.0.0.1", "[::1]", "apiary.example.com"]


def test_no_config_means_loopback_hosts_only():
    from django.conf import settings

    assert "*" not in settings.ALLOWED_HOSTS


def test_allowed_hosts_is_read_from_the_config(tmp_path):
    config = cfg.load(project(tmp_path, f"listen: 0.0.0.0:8080\nworker_token: {TOKEN}\nallowed_hosts: [a.example]\n"))
    assert config.settings.queue.allowed_hosts == ("a.example",)


@pytest.mark.django_db(transaction=True)
def test_the_listener_refuses_a_host_it_does_not_serve(asgi_server, settings, tmp_path):
    from apiary_site import bootstrap

    bootstrap.apply(cfg.load(project(tmp_path, f"listen: 127.0.0.1:8080\nworker_token: {TOKEN}\n")))
    url = f"{asgi_server.url}/api/worker/v1/status"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(url, headers=auth, timeout=10).status_code == 200  # Host: 127.0.0.1:port
    rebound = requests.get(url, headers={**auth, "Host": "attacker.example"}, timeout=10)
    assert rebound.status_code == 400
    admin = requests.get(f"{asgi_server.url}/admin/login/", headers={"Host": "attacker.example"}, timeout=10)
    assert admin.status_code == 400

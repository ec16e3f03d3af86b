"""settings.admin.listen: read and checked (host:port, not the worker protocol's port), a
warning off loopback, its host served (ALLOWED_HOSTS), and the daemon's listener started with it."""

from apiary_site import listener, security
from tests.test_config import TOKEN, errors_of, write
from workflows import config as cfg
from workflows.config import QueueSettings

BASE = """\
project: t
settings:
{settings}
agents:
  - id: sh
    runner: shell
    command: cat
"""


def project(tmp_path, settings: str):
    return write(tmp_path, BASE.format(settings=settings))


def test_it_is_read(tmp_path):
    config = cfg.load(project(tmp_path, "  admin:\n    listen: 127.0.0.1:8000"), environ={})
    assert config.settings.admin.listen == "127.0.0.1:8000"
    assert config.warnings == ()


def test_absent_means_no_admin_listener(tmp_path):
    assert cfg.load(project(tmp_path, "  concurrency: 1"), environ={}).settings.admin.listen is None


def test_a_bad_address_names_the_key(tmp_path):
    [error] = errors_of(project(tmp_path, "  admin:\n    listen: localhost"))
    assert "settings.admin.listen" in error and "expected host:port" in error


def test_an_unknown_key_is_reported(tmp_path):
    [error] = errors_of(project(tmp_path, "  admin:\n    port: 8000"))
    assert "settings.admin" in error and "port" in error


def test_the_worker_protocols_port_is_refused(tmp_path):
    text = f"  queue:\n    listen: 0.0.0.0:8080\n    worker_token: {TOKEN}\n  admin:\n    listen: 127.0.0.1:8080"
    [error] = errors_of(project(tmp_path, text))
    assert "settings.admin.listen" in error and "serves the admin already" in error


def test_off_loopback_is_a_warning(tmp_path):
    config = cfg.load(project(tmp_path, "  admin:\n    listen: 0.0.0.0:8000"), environ={})
    assert any("settings.admin.listen" in w and "plain HTTP" in w for w in config.warnings)


def test_its_host_is_an_allowed_host():
    assert "10.1.2.3" in security.allowed_hosts(QueueSettings(), "10.1.2.3:8000")
    assert "10.1.2.3" not in security.allowed_hosts(QueueSettings())


def test_debug_off_loopback_is_refused():
    [problem] = security.refusals(QueueSettings(), debug=True, admin_listen="0.0.0.0:8000")
    assert "settings.admin.listen" in problem


def test_the_listener_gets_the_admin_address_on_its_command_line(monkeypatch):
    seen = {}
    monkeypatch.setattr(listener.subprocess, "Popen", lambda argv, env: seen.update(argv=argv))
    listener.start(None, config_path="/x/apiary.yaml", admin_bind="127.0.0.1:8000")
    argv = seen["argv"]
    assert "--bind" not in argv and argv[argv.index("--admin-bind") + 1] == "127.0.0.1:8000"


def test_with_the_queues_tls_proxy_it_is_a_warning_that_it_redirects(tmp_path):
    settings = (
        "  admin:\n    listen: 127.0.0.1:8000\n  queue:\n    listen: 127.0.0.1:8080\n"
        f"    worker_token: {TOKEN}\n    tls:\n      proxy_header: X-Forwarded-Proto"
    )
    config = cfg.load(project(tmp_path, settings), environ={})
    assert any("settings.admin.listen" in w and "redirected to https" in w for w in config.warnings)

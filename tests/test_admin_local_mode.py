"""`settings.admin.listen` makes `apiary run` serve the admin and dashboard in local mode
(no settings.queue.listen, no worker token) without exposing the worker protocol: a real
daemon, its real listener, real HTTP."""

import contextlib
import signal
import socket
import urllib.error
import urllib.request

import pytest

from tests.daemon import Daemon, wait_for

pytestmark = pytest.mark.processes

STARTUP = 60.0  # migrate, then gunicorn; generous for a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a local test server
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def answering(url: str):
    try:
        return get(url)
    except OSError:
        return None


@contextlib.contextmanager
def daemon_of(config):
    """`apiary run` on `config`, stopped (SIGTERM, then whatever is left) afterwards."""
    daemon = Daemon(config)
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.send(signal.SIGTERM)
            daemon.wait(timeout=30)
        daemon.stop()


def _config(tmp_path, *settings: str):
    """A project with one shell agent and the given `settings:` lines (flow-style YAML)."""
    config = tmp_path / "apiary.yaml"
    lines = "".join(f"  {line}\n" for line in settings)
    config.write_text(f"project: local\nsettings:\n{lines}agents:\n  - {{id: sh, runner: shell, command: cat}}\n")
    return config


def test_admin_listen_serves_the_admin_and_answers_404_for_the_worker_protocol(tmp_path):
    port = free_port()
    config = _config(tmp_path, f"admin: {{listen: 127.0.0.1:{port}}}")
    with daemon_of(config) as daemon:
        base = f"http://127.0.0.1:{port}"
        status, page = wait_for(lambda: answering(f"{base}/admin/login/"), timeout=STARTUP, what="the admin", daemon=daemon)
        assert status == 200 and "Apiary" in page and "Django administration" not in page
        for path in ("/api/worker/v1/status", "/api/worker/v1/claims", "/api/worker/", "/api/worker"):
            code, body = get(base + path)
            assert code == 404, path
            assert "unsupported_protocol" not in body and "error" not in body  # not the protocol's own 404
        assert get(f"{base}/static/apiary/admin.css")[0] == 200
        assert "admin and dashboard on http://127.0.0.1:" in daemon.output()


def test_beside_the_queue_listener_only_the_protocols_port_answers_the_protocol(tmp_path):
    """Both listens in one listener: the admin's port 404s the protocol, the protocol's port serves it."""
    admin_port, queue_port = free_port(), free_port()
    token = "t" * 40
    config = _config(
        tmp_path, f"admin: {{listen: 127.0.0.1:{admin_port}}}",
        f"queue: {{listen: 127.0.0.1:{queue_port}, worker_token: {token}}}",
    )  # fmt: skip
    with daemon_of(config) as daemon:
        admin, protocol = f"http://127.0.0.1:{admin_port}", f"http://127.0.0.1:{queue_port}"
        wait_for(lambda: answering(f"{admin}/admin/login/"), timeout=STARTUP, what="the admin", daemon=daemon)
        wait_for(lambda: answering(f"{protocol}/admin/login/"), timeout=STARTUP, what="the listener", daemon=daemon)
        assert get(f"{admin}/api/worker/v1/status")[0] == 404
        request = urllib.request.Request(f"{protocol}/api/worker/v1/status", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - a local test server
            assert response.status == 200

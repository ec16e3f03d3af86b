"""The admin's hardening: framing, sniffing, referrer and script-source
headers always; with settings.queue.tls, Secure cookies, HSTS and the HTTPS
redirect (never for the worker protocol); a throttle on login failures; and
`manage.py check --deploy` clean for the README's production configuration."""

import subprocess
from pathlib import Path

import pytest
from django.test import Client

from apiary_site import security
from tests.daemon import clean_env as daemon_env
from tests.daemon import command
from workflows.config import QueueSettings, TlsSettings

pytestmark = pytest.mark.django_db

TOKEN = "canary-admin-headers-7d1e4b2a9c0f5e83"
TLS = QueueSettings(
    listen="127.0.0.1:8080",
    worker_token=TOKEN,
    allowed_hosts=("apiary.example.com",),
    tls=TlsSettings(proxy_header="X-Forwarded-Proto", hsts_include_subdomains=True, hsts_preload=True),
)
HTTPS = {"HTTP_X_FORWARDED_PROTO": "https", "HTTP_HOST": "apiary.example.com"}

README = Path(__file__).resolve().parent.parent / "README.md"


def production_config() -> str:
    """The README's production configuration, as documented (its first yaml block), with a project name."""
    section = README.read_text().split("### Production configuration", 1)[1]
    return "project: prod\n" + section.split("```yaml\n", 1)[1].split("```", 1)[0]


def in_force(settings, queue: QueueSettings) -> None:
    """What bootstrap.apply does, through pytest-django's `settings` so it is undone after the test."""
    settings.APIARY_WORKER_TOKEN = TOKEN
    for name, value in security.django_settings(queue).items():
        setattr(settings, name, value)
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]  # the test client's Host


def test_the_login_page_carries_the_protective_headers(client):
    response = client.get("/admin/login/")
    assert response.status_code == 200
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    csp = response["Content-Security-Policy"]
    for directive in ("default-src 'self'", "script-src 'self'", "frame-ancestors 'none'", "object-src 'none'"):
        assert directive in csp


def test_without_tls_plain_http_is_served_and_cookies_are_not_secure(client, settings):
    in_force(settings, QueueSettings(listen="127.0.0.1:8080", worker_token=TOKEN))
    response = client.get("/admin/login/")
    assert response.status_code == 200
    assert "Strict-Transport-Security" not in response
    assert not response.cookies["csrftoken"]["secure"]


def test_with_tls_plain_http_is_redirected_to_https(settings):
    in_force(settings, TLS)
    response = Client().get("/admin/login/", HTTP_HOST="apiary.example.com")
    assert response.status_code == 301
    assert response["Location"] == "https://apiary.example.com/admin/login/"


def test_with_tls_cookies_are_secure_and_hsts_is_sent(settings, admin_user):
    in_force(settings, TLS)
    client = Client()
    page = client.get("/admin/login/", **HTTPS)
    assert page.status_code == 200
    assert page["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    assert page.cookies["csrftoken"]["secure"]
    login = client.post("/admin/login/", {"username": "admin", "password": "password"}, **HTTPS)
    assert login.status_code == 302
    assert login.cookies["sessionid"]["secure"]
    assert login.cookies["sessionid"]["httponly"]


def test_with_tls_the_worker_protocol_is_not_redirected(settings):
    in_force(settings, TLS)
    response = Client().get("/api/worker/v1/status", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200


def test_the_proxy_header_is_the_configured_one(settings):
    assert security.django_settings(TLS)["SECURE_PROXY_SSL_HEADER"] == ("HTTP_X_FORWARDED_PROTO", "https")
    assert security.django_settings(QueueSettings())["SECURE_PROXY_SSL_HEADER"] is None


def test_five_failed_logins_lock_the_username_out(client, admin_user):
    for _ in range(4):
        failed = client.post("/admin/login/", {"username": "admin", "password": "wrong"})
        assert failed.status_code == 200  # the form again, with its error
    assert client.post("/admin/login/", {"username": "admin", "password": "wrong"}).status_code == 429
    locked = client.post("/admin/login/", {"username": "admin", "password": "password"})
    assert locked.status_code == 429
    assert "_auth_user_id" not in client.session
    # From another address too: the username is locked, not only the address.
    elsewhere = Client(REMOTE_ADDR="10.9.8.7").post("/admin/login/", {"username": "admin", "password": "password"})
    assert elsewhere.status_code == 429


def test_behind_the_proxy_the_throttle_counts_the_forwarded_client(settings, rf):
    in_force(settings, TLS)
    request = rf.get("/", HTTP_X_FORWARDED_FOR="6.6.6.6, 203.0.113.9", REMOTE_ADDR="127.0.0.1")
    assert security.client_ip(request) == "203.0.113.9"  # the entry the proxy appended, not the client's own
    settings.SECURE_PROXY_SSL_HEADER = None
    assert security.client_ip(request) == "127.0.0.1"  # no proxy configured: the header is the client's word


def check_deploy(tmp_path, config: str, *flags: str) -> subprocess.CompletedProcess:
    """`apiary check --deploy` (Django's, with apiary.yaml in force) on `config`, as a process."""
    (tmp_path / "apiary.yaml").write_text(config)
    return subprocess.run(
        command("check", "--deploy", *flags, "--config", str(tmp_path / "apiary.yaml")),
        cwd=tmp_path,
        env=daemon_env(APIARY_WORKER_TOKEN="k" * 40),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.processes
def test_check_deploy_is_clean_for_the_production_configuration(tmp_path):
    proc = check_deploy(tmp_path, production_config(), "--fail-level", "WARNING")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "System check identified no issues" in proc.stdout


@pytest.mark.processes
def test_check_deploy_names_what_a_config_without_tls_lacks(tmp_path):
    proc = check_deploy(tmp_path, production_config().split("    tls:")[0])
    found = {w for w in ("W002", "W004", "W008", "W012", "W016") if f"security.{w}" in proc.stdout + proc.stderr}
    assert found == {"W004", "W008", "W012", "W016"}  # W002 (X-Frame-Options) never: the middleware is always on


@pytest.mark.django_db(transaction=True)
def test_the_lockout_holds_under_the_listeners_asgi_handler(asgi_server, admin_user):
    import requests

    session = requests.Session()
    url = f"{asgi_server.url}/admin/login/"

    def attempt(password: str) -> int:
        session.get(url, timeout=10)
        form = {"username": "admin", "password": password, "csrfmiddlewaretoken": session.cookies["csrftoken"]}
        return session.post(url, data=form, headers={"Referer": url}, timeout=10, allow_redirects=False).status_code

    assert [attempt("wrong") for _ in range(5)] == [200, 200, 200, 200, 429]
    assert attempt("password") == 429

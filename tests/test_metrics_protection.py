"""Who may scrape `/metrics`: with settings.metrics.token, whoever sends it as
a Bearer token (and nobody else, the worker token included); without it,
loopback clients only, and none when the listener sits behind the TLS proxy
of settings.queue.tls (through it every client would look local). The config
refuses an address other machines reach without a token, a short token, and
a worker token reused as the scrapers'."""

import pytest
from django.test import Client

from workflows.config import ConfigError, MetricsSettings, load

pytestmark = pytest.mark.django_db

WORKER_TOKEN = "canary-worker-token-metrics-4b1f9e2a7c"
SCRAPE_TOKEN = "canary-scrape-token-metrics-8d2c6a1e5f"


def get(path="/metrics", *, peer="127.0.0.1", **headers):
    return Client().get(path, REMOTE_ADDR=peer, **headers)


@pytest.fixture
def no_token(settings):
    settings.APIARY_METRICS = MetricsSettings()
    settings.APIARY_WORKER_TOKEN = WORKER_TOKEN


@pytest.fixture
def with_token(settings):
    settings.APIARY_METRICS = MetricsSettings(token=SCRAPE_TOKEN)
    settings.APIARY_WORKER_TOKEN = WORKER_TOKEN


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1"])
def test_without_a_token_a_loopback_client_scrapes(no_token, peer):
    response = get(peer=peer)
    assert response.status_code == 200
    assert b"apiary_jobs" in response.content


@pytest.mark.parametrize("peer", ["10.0.0.5", "192.168.1.20", "2001:db8::1", ""])
def test_without_a_token_any_other_client_is_refused(no_token, peer):
    response = get(peer=peer, HTTP_AUTHORIZATION=f"Bearer {WORKER_TOKEN}")  # the worker token opens nothing here
    assert response.status_code == 403
    assert b"settings.metrics.token" in response.content
    assert b"apiary_" not in response.content


def test_behind_the_tls_proxy_loopback_is_not_trusted(no_token, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")  # settings.queue.tls in force
    response = get(peer="127.0.0.1", HTTP_X_FORWARDED_PROTO="https")
    assert response.status_code == 403
    assert b"proxy" in response.content


def test_with_a_token_a_remote_scraper_presenting_it_scrapes(with_token, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    response = get(peer="10.0.0.5", HTTP_AUTHORIZATION=f"Bearer {SCRAPE_TOKEN}", HTTP_X_FORWARDED_PROTO="https")
    assert response.status_code == 200
    assert b"apiary_claims_total" in response.content


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {WORKER_TOKEN}", f"Bearer {SCRAPE_TOKEN}x", f"Basic {SCRAPE_TOKEN}", "Bearer ", SCRAPE_TOKEN],
)
def test_with_a_token_anything_else_is_refused_even_from_loopback(with_token, authorization):
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization is not None else {}
    response = get(peer="127.0.0.1", **headers)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"apiary_" not in response.content
    assert SCRAPE_TOKEN.encode() not in response.content


def test_only_get_and_head_are_answered(no_token):
    assert Client().post("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 405


def test_healthz_needs_no_token(with_token):
    assert get("/healthz", peer="10.0.0.5").status_code in (200, 503)  # answered, not refused


# --- the config -------------------------------------------------------------------------------------

MINIMAL = """\
project: p
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: feed, type: command, command: "true", workflows: [w]}]
"""


def errors_of(tmp_path, settings_yaml: str) -> list[str]:
    path = tmp_path / "apiary.yaml"
    path.write_text(MINIMAL + settings_yaml)
    try:
        load(path)
    except ConfigError as exc:
        return exc.errors
    return []


def test_config_a_loopback_address_needs_no_token(tmp_path):
    path = tmp_path / "apiary.yaml"
    path.write_text(MINIMAL + "settings: {metrics: {listen: '127.0.0.1:9464'}}\n")
    assert load(path).settings.metrics == MetricsSettings(listen="127.0.0.1:9464")


def test_config_an_address_others_reach_needs_a_token(tmp_path):
    [error] = errors_of(tmp_path, "settings: {metrics: {listen: '0.0.0.0:9464'}}\n")
    assert "settings.metrics.listen" in error and "settings.metrics.token" in error
    assert errors_of(tmp_path, f"settings: {{metrics: {{listen: '0.0.0.0:9464', token: {SCRAPE_TOKEN}}}}}\n") == []


@pytest.mark.parametrize(
    "line, path, says",
    [
        ("settings: {metrics: {token: short}}", "settings.metrics.token", "at least 32"),
        (f"settings: {{queue: {{worker_token: {WORKER_TOKEN}}}, metrics: {{token: {WORKER_TOKEN}}}}}", "settings.metrics.token", "worker token"),
        ("settings: {metrics: {listen: nowhere}}", "settings.metrics.listen", "host:port"),
        ("settings: {metrics: {port: 9464}}", "settings.metrics.port", "unknown"),
    ],
)
def test_config_bad_metrics_settings_are_named(tmp_path, line, path, says):
    errors = errors_of(tmp_path, line + "\n")
    assert any(path in e and says in e for e in errors), errors
    assert not any(WORKER_TOKEN in e for e in errors)  # a secret is never echoed

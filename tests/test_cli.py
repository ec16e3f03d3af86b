"""The `apiary` front door: words to Django commands, and `--config` read before settings."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apiary_site import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("words", "routed"),
    [
        (["run", "--until-idle"], ["runapiary", "--until-idle"]),
        (["check"], ["checkconfig"]),
        (["worker", "--id", "w1"], ["worker", "--id", "w1"]),
        (["worker", "drain", "w1"], ["drainworker", "w1"]),
        (["worker", "undrain", "w1"], ["undrainworker", "w1"]),
        (["worker", "token", "list"], ["workertoken", "list"]),
        (["createsuperuser", "--noinput"], ["apiarysuperuser", "--noinput"]),
        (["help", "worker", "drain"], ["drainworker", "--help"]),
        (["help", "--commands"], ["help", "--commands"]),
        (["status", "--json"], ["status", "--json"]),
        (["migrate"], ["migrate"]),
        ([], []),
        (["--help"], []),
    ],
)
def test_route(words, routed):
    assert cli.route(["apiary", *words]) == (["apiary", *routed] if routed else [])


def test_config_is_read_before_django(tmp_path, monkeypatch):
    monkeypatch.delenv("APIARY_CONFIG", raising=False)
    assert cli._config_from_argv(["apiary", "run", "--config", "x/apiary.yaml"]) == "x/apiary.yaml"
    assert cli._config_from_argv(["apiary", "run", "--config=y.yaml"]) == "y.yaml"
    assert cli._config_from_argv(["apiary", "status"]) is None


def test_usage_lists_the_commands():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_"))}
    out = subprocess.run(
        [sys.executable, "-c", "from apiary_site.cli import main; main(['apiary'])"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )
    assert out.returncode == 0
    for word in ("run", "check", "status", "worker drain ID", "task add", "cancel INSTANCE", "affinity release TASK"):
        assert word in out.stdout


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://u@h/db", "apiary: DATABASE_URL must start with postgres:// or postgresql://, got mysql://…"),
        ("postgres://u@h/db?prepare_threshold=five", "apiary: DATABASE_URL: prepare_threshold must be a whole number or none, got 'five'"),
    ],
)  # fmt: skip
def test_a_database_url_the_settings_refuse_is_one_line_not_a_traceback(tmp_path, url, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APIARY_", "DJANGO_"))} | {"DATABASE_URL": url}
    out = subprocess.run(
        [sys.executable, "-c", "from apiary_site.cli import main; main(['apiary', 'status'])"],
        capture_output=True, text=True, cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, timeout=60,
    )
    assert (out.returncode, out.stderr) == (2, says + "\n")

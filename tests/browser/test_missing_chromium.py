"""Without a Chromium the browser suite skips and says why, except under
APIARY_REQUIRE_BROWSER=1 (set by .ci/run), where that is a failure: CI must
never pass by skipping every browser test. Runs pytest on one browser module
in a subprocess with $APIARY_CHROMIUM pointing at nothing; needs no browser."""

import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.processes

MODULE = "tests/browser/test_admin_login.py"


def run_browser_module(**env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("APIARY_REQUIRE_BROWSER", "PYTEST_ADDOPTS")}
    environment.update(APIARY_CHROMIUM="/nonexistent/chromium", **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-rs", MODULE],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=300, check=False,
    )


def test_without_chromium_the_browser_tests_skip_and_say_why():
    result = run_browser_module()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout, result.stdout
    assert "no Chromium to drive ($APIARY_CHROMIUM=/nonexistent/chromium is not executable)" in result.stdout


def test_without_chromium_the_browser_tests_fail_when_a_browser_is_required():
    result = run_browser_module(APIARY_REQUIRE_BROWSER="1")
    assert result.returncode != 0, result.stdout
    assert "APIARY_REQUIRE_BROWSER=1: no Chromium to drive" in result.stdout, result.stdout
    assert "skipped" not in result.stdout

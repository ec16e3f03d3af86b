"""Which Chromium the browser tests drive, and what happens without one.

Playwright drives the system's Chromium (Debian's `chromium` package, which
.ci/run installs like PostgreSQL); Playwright's own browser download is never
used. `$APIARY_CHROMIUM` names another binary. Without a browser (or without
the playwright package) the browser tests skip with the reason, unless
`APIARY_REQUIRE_BROWSER=1` (CI), which makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # missing() says so, and the browser fixture skips (or fails) every test
    expect = None

__all__ = ["executable", "expect", "missing", "required", "unavailable"]

CANDIDATES = ("chromium", "chromium-browser")


def executable() -> str | None:
    """The Chromium binary to launch, or None."""
    named = os.environ.get("APIARY_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (scripts/setup installs requirements-test.txt)"
    if executable() is None:
        where = f"$APIARY_CHROMIUM={os.environ['APIARY_CHROMIUM']} is not executable" if os.environ.get(
            "APIARY_CHROMIUM") else f"none of {', '.join(CANDIDATES)} on PATH"
        return f"no Chromium to drive ({where}); install Debian's chromium package (apt-get install chromium)"
    return None


def required() -> bool:
    return os.environ.get("APIARY_REQUIRE_BROWSER") == "1"


def unavailable(reason: str):
    """Skip the test, or fail it when a browser is required."""
    if required():
        pytest.fail(f"APIARY_REQUIRE_BROWSER=1: {reason}", pytrace=False)
    pytest.skip(reason)

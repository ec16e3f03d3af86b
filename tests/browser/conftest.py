"""Fixtures of the browser suite: a real control plane, headless Chromium, pages.

    browser      module   headless Chromium through Playwright (tests/browser/chromium.py
                          says which binary; skipped, or failed under APIARY_REQUIRE_BROWSER=1,
                          without one)
    console      module   `apiary run` on a free loopback port with a superuser (console.Console)
    seeded       module   console.seed(): worker alpha-1 and a failed, a running, queued and
                          blocked jobs; their ids (console.Seeded)
    page         test     a fresh context's page, not logged in, base URL the console's
    admin_page   test     the same, logged in as console.USERNAME (one form login per module)
    screenshot   test     screenshot(page, "name") saves ARTIFACTS/name.png and returns its path

Every context is new for its test (no cookies carried over) and waits at most
TIMEOUT for any element or navigation; a test that fails leaves a full-page
screenshot and the page's HTML in ARTIFACTS, named after the test.

Playwright's sync API runs an event loop on this thread while it is open, and
Django refuses ORM calls from a thread with a running loop: the browser lives
for one module, so the rest of the suite never sees it. These tests read the
queue through `apiary` commands and the control plane's own database file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from . import chromium
from .console import Console
from .pages import log_in

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("APIARY_TEST_ARTIFACTS") or REPO / "test-artifacts") / "screenshots"
TIMEOUT = 15_000  # ms; a deadline for the shared machine, never a measure of speed
VIEWPORT = {"width": 1280, "height": 900}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for the page fixtures' teardown."""
    report = yield
    setattr(item, f"apiary_report_{report.when}", report)
    return report


def artefact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_')}.png"


@pytest.fixture(scope="module")
def browser():
    reason = chromium.missing()
    if reason:
        chromium.unavailable(reason)
    from playwright.sync_api import sync_playwright

    chromium.expect.set_options(timeout=TIMEOUT)
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=chromium.executable(), headless=True)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    plane = Console(tmp_path_factory.mktemp("console"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def seeded(console):
    return console.seed()


def new_context(browser, console, **options):
    context = browser.new_context(base_url=console.url, viewport=VIEWPORT, **options)
    context.set_default_timeout(TIMEOUT)
    return context


@pytest.fixture(scope="module")
def operator_state(browser, console) -> dict:
    """Cookies of one login through the form, for every `admin_page` of the module."""
    context = new_context(browser, console)
    try:
        page = context.new_page()
        page.goto("/admin/login/?next=/admin/")
        log_in(page)
        page.wait_for_url("**/admin/")
        return context.storage_state()
    finally:
        context.close()


def _page(request, context):
    page = context.new_page()
    try:
        yield page
    finally:
        report = getattr(request.node, "apiary_report_call", None)
        if report is not None and report.failed and not page.is_closed():
            path = artefact(request.node.nodeid)
            page.screenshot(path=path, full_page=True)
            path.with_suffix(".html").write_text(page.content())
        context.close()


@pytest.fixture
def page(request, browser, console):
    yield from _page(request, new_context(browser, console))


@pytest.fixture
def admin_page(request, browser, console, operator_state):
    yield from _page(request, new_context(browser, console, storage_state=operator_state))


@pytest.fixture
def screenshot():
    """screenshot(page, "admin-index") -> the path of the full-page PNG it saved."""

    def save(page, name: str) -> Path:
        path = artefact(name)
        page.screenshot(path=path, full_page=True)
        return path

    return save

"""The admin's login form in a real browser: the operator gets in, a wrong password does not.

django-axes counts the refusal (apiary_site/settings.py: AXES_*); one failure
is far from its lockout, which would shut out this address for every later test.
"""

import re

import pytest

from .chromium import expect
from .console import USERNAME
from .pages import log_in

pytestmark = [pytest.mark.browser, pytest.mark.processes]


def test_the_login_form_lets_the_operator_in(page, console):
    page.goto("/admin/queue/job/")
    expect(page).to_have_url(re.compile(r"/admin/login/\?next=/admin/queue/job/$"))
    log_in(page)
    expect(page).to_have_url(console.admin_url("queue/job/"))
    expect(page.locator("#user-tools")).to_contain_text(USERNAME)


def test_a_wrong_password_is_refused_and_counted(page, console):
    page.goto("/admin/login/?next=/admin/")
    log_in(page, password="not-the-password")
    expect(page.locator(".errornote")).to_contain_text("correct username and password")
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    page.goto("/admin/queue/job/")
    expect(page).to_have_url(re.compile(r"/admin/login/"))  # still nobody
    assert console.value("SELECT failures_since_start FROM axes_accessattempt WHERE username = ?", USERNAME) == 1

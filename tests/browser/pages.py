"""What the browser tests do on admin pages and where they look: one place
to change when a template moves an element."""

from __future__ import annotations

import re

from .console import PASSWORD, USERNAME


def log_in(page, username: str = USERNAME, password: str = PASSWORD) -> None:
    """Fill in and send the admin's login form (the page is on it)."""
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("#login-form [type=submit]")


def job_row(page, job_id: int):
    """A changelist's row of an object, found by its action checkbox (the job list's, by job id)."""
    return page.locator(f"#result_list tbody tr:has(input[name=_selected_action][value='{job_id}'])")


def cell(page, job_id: int, field: str):
    """The `list_display` column `field` of a row (Django's `td.field-NAME`)."""
    return job_row(page, job_id).locator(f"td.field-{field}")


def run_action(page, object_ids, action: str) -> None:
    """Tick the rows, choose `action` (its name, e.g. "cancel_jobs") and press Go."""
    for object_id in object_ids:
        job_row(page, object_id).locator("input[name=_selected_action]").check()
    page.select_option("select[name=action]", action)
    page.click("button[name=index]")


def messages(page):
    """The admin's message list (what an action reported)."""
    return page.locator("ul.messagelist")


def exactly(text: str) -> re.Pattern:
    """The whole (trimmed) text, any case: the admin shows a choice's label ("Queued"), not its value."""
    return re.compile(rf"^\s*{re.escape(text)}\s*$", re.IGNORECASE)

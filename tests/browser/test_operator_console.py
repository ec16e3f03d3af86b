"""The operator console in a real browser, over a seeded control plane with a
remote worker (tests/browser/console.py): the dashboard shows the queue as
`apiary status --json` counts it, a running step's log tail reaches the
instance page while the step runs, and Retry on a failed job's page queues
it again. The dashboard and the running instance are kept as screenshots
(the README's operator guide shows them: docs/screenshots/)."""

import re

import pytest

from .chromium import expect
from .console import WORKER_ID
from .pages import messages

pytestmark = [pytest.mark.browser, pytest.mark.processes]


def table(page, selector: str) -> list[dict[str, str]]:
    """A dashboard table as rows of {column header: cell text}."""
    headers = [h.strip() for h in page.locator(f"{selector} thead th").all_text_contents()]
    return [
        dict(zip(headers, (c.strip() for c in row.locator("td").all_text_contents()), strict=True))
        for row in page.locator(f"{selector} tbody tr").all()
    ]


def test_the_dashboard_shows_the_queue_as_status_counts_it(admin_page, console, seeded, screenshot):
    admin_page.goto("/admin/")
    expect(admin_page.locator("#apiary-running")).to_contain_text(str(seeded.running))
    status = console.status()

    [project] = table(admin_page, "#apiary-by-project table")  # one project in the seed
    assert {state: int(project[state] or 0) for state in status["jobs"]} == status["jobs"]
    by_pool = {row["pool"]: row for row in table(admin_page, "#apiary-by-pool table")}
    assert (by_pool["alpha"]["failed"], by_pool["alpha"]["leased"], by_pool["beta"]["queued"]) == ("1", "1", "2")
    expect(admin_page.locator("#apiary-blocked")).to_contain_text("no worker in pool beta")
    # The running job: its remote worker and the step it streams output for.
    [running] = [r for r in table(admin_page, "#apiary-running table") if r["job"].startswith(str(seeded.running))]
    assert (running["worker"], running["step"]) == (WORKER_ID, "work")
    screenshot(admin_page, "dashboard")


def test_a_running_steps_log_tail_is_on_its_instance_page(admin_page, seeded, screenshot):
    admin_page.goto(f"/admin/workflows/workflowinstance/{seeded.instances[seeded.running]}/change/")
    expect(admin_page.get_by_text(re.compile("compiling part 3 of 3"))).to_be_visible()
    expect(admin_page.locator("body")).to_contain_text("running")
    screenshot(admin_page, "instance-running")


def test_retry_from_a_failed_jobs_page_queues_it_again(admin_page, console, seeded):
    before = console.status()
    attempts = len(console.attempts(seeded.failed))
    admin_page.goto(f"/admin/queue/job/{seeded.failed}/change/")
    admin_page.locator("button.apiary-retry").click()
    expect(messages(admin_page)).to_contain_text(f"job {seeded.failed} was failed; queued again", ignore_case=True)

    after = console.status()
    assert after["jobs"]["failed"] == before["jobs"]["failed"] - 1
    assert after["jobs"]["queued"] == before["jobs"]["queued"] + 1
    # The same job: its attempts so far stay, the next claim is a new one (the worker is busy).
    assert len(console.attempts(seeded.failed)) == attempts
    assert console.value("SELECT state FROM queue_job WHERE id = ?", seeded.failed) == "queued"

"""The queue in the admin, in a real browser, over a seeded control plane
(tests/browser/console.py): the job list shows each job where it is, a cancel
chosen from the list's actions reaches the queue (read back through
`apiary status --json`), and the index and a job page are kept as screenshots.
"""

import pytest

from .chromium import expect
from .console import WORKER_ID
from .pages import cell, exactly, job_row, messages, run_action

pytestmark = [pytest.mark.browser, pytest.mark.processes]

PNG = b"\x89PNG\r\n\x1a\n"


def blocked_ids(status: dict) -> set[int]:
    return {b["job_id"] for b in status["blocked"]}


def test_the_job_list_shows_the_seeded_jobs_in_their_states(admin_page, seeded):
    admin_page.goto("/admin/queue/job/")
    expect(cell(admin_page, seeded.failed, "state")).to_have_text(exactly("failed"))
    expect(cell(admin_page, seeded.running, "state")).to_have_text(exactly("leased"))
    for job_id in (*seeded.queued, seeded.blocked):
        expect(cell(admin_page, job_id, "state")).to_have_text(exactly("queued"))
    expect(cell(admin_page, seeded.blocked, "pool")).to_have_text("beta")

    admin_page.locator("#changelist-filter").get_by_role("link", name=exactly("failed")).click()
    expect(admin_page.locator("#result_list tbody tr")).to_have_count(1)
    expect(job_row(admin_page, seeded.failed)).to_be_visible()


def test_cancel_from_the_job_list_takes_effect(admin_page, console, seeded):
    before = console.status()
    assert {seeded.blocked, seeded.to_cancel} <= blocked_ids(before)

    admin_page.goto("/admin/queue/job/")
    run_action(admin_page, [seeded.to_cancel], "cancel_jobs")
    expect(messages(admin_page)).to_contain_text(f"cancelled: job {seeded.to_cancel}", ignore_case=True)
    expect(cell(admin_page, seeded.to_cancel, "state")).to_have_text(exactly("cancelled"))

    after = console.status()
    assert after["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1
    assert after["jobs"]["queued"] == before["jobs"]["queued"] - 1
    assert blocked_ids(after) == blocked_ids(before) - {seeded.to_cancel}  # that job only


def test_screenshots_of_the_admin_index_and_a_running_job(admin_page, seeded, screenshot):
    admin_page.goto("/admin/")
    expect(admin_page.locator("#user-tools")).to_be_visible()
    index = screenshot(admin_page, "admin-index")

    admin_page.goto(f"/admin/queue/job/{seeded.running}/change/")
    expect(admin_page.locator("#attempts-group")).to_contain_text(WORKER_ID)
    job = screenshot(admin_page, "admin-job-running")

    for path in (index, job):
        assert path.read_bytes().startswith(PNG), path

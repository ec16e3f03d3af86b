"""Operator commands: status, cancel, affinity release, drainworker (and their `apiary` routes)."""

import io
import json

import pytest
from django.core.management import CommandError, call_command

from apiary_site import cli
from apiary_site.management.commands.status import render_status
from jobqueue import conf, services
from jobqueue.models import Affinity, Job, JobState, Worker
from jobqueue.selectors import credential_of, status_document
from tests.factories import claim, enqueue, instance_id, make_task, register, task_id
from workflows import config as cfg
from workflows.services import affinity_key

pytestmark = pytest.mark.django_db

CONFIG = """\
project: t
settings:
  queue:
    lease_duration: 8s
    heartbeat_interval: 2s
    worker_timeout: 5s
"""


@pytest.fixture(autouse=True)
def no_ambient_config(monkeypatch, tmp_path, queue_config, settings):
    """No apiary.yaml unless a test names one; whatever a command puts in
    force (queue settings, worker token) is undone after the test."""
    monkeypatch.delenv("APIARY_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    settings.APIARY_WORKER_TOKEN = ""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "conf" / "apiary.yaml"
    path.parent.mkdir()
    path.write_text(CONFIG)
    return path


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


# --------------------------------------------------------------------------- status


def test_status_json_is_exactly_the_document(clock):
    worker = register("w1")
    enqueue()
    enqueue(pool="build")
    claim(worker)
    out = run("status", "--json")
    assert json.loads(out) == status_document()
    assert json.loads(out)["blocked"][0]["reason"] == "no worker in pool build"


def test_status_text_table(clock, config_file):
    worker = register("w1", capacity=2)
    running = enqueue(workflow="triage")
    claim(worker)
    blocked = enqueue(pool="build")
    enqueue()  # claimable (w1 has a free slot): not blocked
    out = run("status", "--config", str(config_file))
    assert "Jobs: queued 2  leased 1  succeeded 0  failed 0  cancelled 0" in out
    worker_line = next(line for line in map(str.strip, out.splitlines()) if line.startswith("w1 "))
    assert worker_line.split() == ["w1", "-", "healthy", "2", "1", "no", "yes", "2026-01-01T00:00:00Z"]
    running_line = next(line for line in map(str.strip, out.splitlines()) if line.startswith(f"{running.pk} "))
    assert running_line.split() == [
        str(running.pk),
        str(instance_id(running)),
        str(task_id(running)),
        "triage",
        "-",  # PARENT: not a spawned task's
        "w1",
        "1",
        "2026-01-01T00:00:30Z",  # claimed under the default 30 s lease, before the config was read
    ]
    blocked_section = out.split("Blocked\n", 1)[1].splitlines()
    assert blocked_section[1].split(maxsplit=1) == [str(blocked.pk), "no worker in pool build"]
    assert "WARNING" not in out


def test_status_warns_when_no_healthy_worker_can_take_queued_jobs(clock, queue_config):
    queue_config(worker_timeout=30)
    register("w1")
    enqueue()
    assert "WARNING" not in run("status")
    clock.advance(31)
    out = run("status")
    assert "stale" in out
    assert "WARNING: 1 queued job(s) and no healthy, ready, non-draining worker to take them" in out


def test_status_warns_when_every_queued_job_is_blocked(clock):
    register("w1")
    enqueue(pool="build")
    assert "WARNING: none of the 1 queued job(s) can be taken by any worker now" in run("status")


def test_status_names_the_project_limit_that_keeps_jobs_from_idle_workers(clock, tmp_path):
    path = tmp_path / "apiary.yaml"
    path.write_text("project: hello\nsettings:\n  concurrency: 2\n")
    conf.configure(cfg.load(path, environ={}).queue_config())  # as `apiary run` would (undone by the fixture)
    workers = [register(f"w{i}", capacity=4) for i in range(3)]
    for _ in range(5):
        enqueue(project="hello")
    assert sum(len(claim(w, max_jobs=4)) for w in workers) == 2  # ten free slots stay free

    reason = "project limit hello: 2 of 2 running"
    doc = json.loads(run("status", "--json", "--config", str(path)))
    assert [b["reason"] for b in doc["blocked"]] == [reason] * 3
    out = run("status", "--config", str(path))
    blocked_section = out.split("Blocked\n", 1)[1].splitlines()
    assert [line.split(maxsplit=1)[1] for line in blocked_section[1:4]] == [reason] * 3
    assert "WARNING: none of the 3 queued job(s) can be taken by any worker now" in out


def test_render_status_of_an_empty_document():
    text = render_status(
        {
            "jobs": {"queued": 0, "leased": 0, "succeeded": 0, "failed": 0, "cancelled": 0},
            "workers": [],
            "active": [],
            "blocked": [],
        }
    )
    assert "(no worker registered)" in text
    assert "WARNING" not in text


def test_status_puts_the_config_in_force(clock, config_file):
    register("w1")
    clock.advance(6)  # past the file's worker_timeout (5 s), well within the default 30 s
    assert json.loads(run("status", "--json"))["workers"][0]["health"] == "healthy"
    assert json.loads(run("status", "--json", "--config", str(config_file)))["workers"][0]["health"] == "stale"


def test_status_finds_apiary_yaml_in_the_current_directory(clock, config_file, monkeypatch):
    monkeypatch.chdir(config_file.parent)
    register("w1")
    clock.advance(6)
    assert json.loads(run("status", "--json"))["workers"][0]["health"] == "stale"


def test_status_with_a_missing_config_fails_with_exit_2(clock, tmp_path):
    with pytest.raises(CommandError, match="config file not found") as info:
        run("status", "--config", str(tmp_path / "nope.yaml"))
    assert info.value.returncode == 2


def test_status_remote_needs_a_url_and_a_token(clock, monkeypatch):
    # The remote variant itself runs against a real control plane in tests/remote.
    monkeypatch.delenv("APIARY_WORKER_TOKEN", raising=False)
    with pytest.raises(CommandError, match="add --control-plane URL") as info:
        run("status", "--token", "t")
    assert info.value.returncode == 2
    with pytest.raises(CommandError, match="pass --token or set APIARY_WORKER_TOKEN") as info:
        run("status", "--control-plane", "http://cp:8080")
    assert info.value.returncode == 2


# --------------------------------------------------------------------------- cancel


def test_cancel_queued_instance_at_once(clock):
    job = enqueue()
    out = run("cancel", str(instance_id(job)))
    assert out.strip() == f"instance {instance_id(job)} (job {job.pk}) cancelled"
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    out = run("cancel", str(instance_id(job)))
    assert "already cancelled; nothing to cancel" in out


def test_cancel_running_instance_requests_it(clock):
    worker = register("w1")
    job = enqueue()
    [c] = claim(worker)
    out = run("cancel", str(instance_id(job)))
    assert "cancel requested; the worker stops it at its next heartbeat" in out
    job.refresh_from_db()
    assert job.state == JobState.LEASED and job.cancel_requested_at == clock.now()
    assert services.attempt_heartbeat(attempt_id=c.attempt_id, token=c.token).cancel
    assert "cancel was already requested" in run("cancel", str(instance_id(job)))


def test_cancel_finished_instance_changes_nothing(clock):
    worker = register("w1")
    job = enqueue()
    [c] = claim(worker)
    services.attempt_finish(attempt_id=c.attempt_id, token=c.token, outcome="succeeded")
    assert "already succeeded; nothing to cancel" in run("cancel", str(instance_id(job)))
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


def test_cancel_unknown_instance_names_it(clock):
    with pytest.raises(CommandError, match="no workflow instance 4242"):
        run("cancel", "4242")


# --------------------------------------------------------------------------- affinity


def test_affinity_release(clock):
    worker = register("w1")
    task = make_task()
    enqueue(task, affinity=True)
    claim(worker)
    assert Affinity.objects.filter(key=affinity_key(task.pk)).exists()
    assert run("affinity", "release", str(task.pk)).strip() == f"task {task.pk}: released its pin to worker w1"
    assert not Affinity.objects.filter(key=affinity_key(task.pk)).exists()
    assert run("affinity", "release", str(task.pk)).strip() == f"task {task.pk} was not pinned"


def test_affinity_release_unknown_task(clock):
    with pytest.raises(CommandError, match="no task 777"):
        run("affinity", "release", "777")


# --------------------------------------------------------------------------- drainworker


def test_drainworker_and_undo(clock):
    worker = register("w1")
    enqueue()
    assert "drain requested" in run("drainworker", "w1")
    assert Worker.objects.get(pk="w1").drain_requested
    assert claim(worker) == []  # the claim obeys it at once
    assert services.worker_heartbeat(worker_id="w1", session=worker.session).drain_requested
    assert "drain request withdrawn" in run("drainworker", "w1", "--undo")
    assert not Worker.objects.get(pk="w1").drain_requested
    assert len(claim(worker)) == 1


def test_drainworker_unknown(clock):
    with pytest.raises(CommandError, match="no worker 'ghost'"):
        run("drainworker", "ghost")


# --------------------------------------------------------------------------- through the `apiary` entry point


def apiary(*words: str) -> str:
    """Run `apiary WORDS…` as the console script routes it, in this process.
    (Not through cli.main: Django's run_from_argv closes every connection
    afterwards, which would close the test's own database connection.)"""
    argv = cli.route(["apiary", *words])
    return run(*argv[1:])


def test_apiary_routes(clock, config_file):
    assert cli.route(["apiary", "worker", "drain", "w1"]) == ["apiary", "drainworker", "w1"]
    assert cli.route(["apiary", "affinity", "release", "5"]) == ["apiary", "affinity", "release", "5"]
    register("w1")
    apiary("worker", "drain", "w1", "--config", str(config_file))
    assert Worker.objects.get(pk="w1").drain_requested
    apiary("worker", "undrain", "w1")
    assert not Worker.objects.get(pk="w1").drain_requested
    assert json.loads(apiary("status", "--json", "--config", str(config_file)))["workers"][0]["worker_id"] == "w1"
    job = enqueue()
    apiary("cancel", str(instance_id(job)), "--config", str(config_file))
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


@pytest.mark.parametrize(
    "words", [("cancel", "999"), ("affinity", "release", "999"), ("worker", "drain", "ghost")], ids=" ".join
)
def test_unknown_ids_exit_non_zero(clock, words):
    """run_from_argv turns a CommandError into `sys.exit(returncode)`: non-zero, the message on stderr."""
    with pytest.raises(CommandError) as info:
        apiary(*words)
    assert info.value.returncode == 1
    assert words[-1] in str(info.value)


def test_status_table_shows_a_dash_for_what_a_jobs_payload_does_not_name(clock):
    # The queue reads instance, task and workflow from the payload; a job enqueued
    # without them (not by the workflow layer) must not break the table.
    job, _ = services.job_enqueue(key="bare", payload={}, agent="a", runner="shell", project="p", source="s",
                                  capabilities=["apiary.workflow", "runner:shell"])
    worker = register("w1")
    services.jobs_claim(worker_id=worker.worker_id, session=worker.session)
    text = render_status(status_document())
    row = next(line for line in text.splitlines() if line.strip().startswith(f"{job.pk} "))  # not 1 on PostgreSQL
    assert row.split()[1:4] == ["-", "-", "-"]


# --------------------------------------------------------------------------- apiary worker token


def test_worker_token_create_prints_a_credential_once_that_registers_that_worker(clock):
    out, err = io.StringIO(), io.StringIO()
    call_command("workertoken", "create", "build-1", stdout=out, stderr=err)
    secret = out.getvalue().strip()
    assert secret.startswith("apw_") and "shown once" in err.getvalue() and secret not in err.getvalue()
    listing = run("workertoken", "list")
    assert "build-1" in listing and "operator" in listing and secret not in listing
    assert credential_of(secret)[1] == "build-1"


def test_worker_token_revoke_and_revoke_previous(clock):
    _, first = services.credential_issue(worker_id="w1")
    clock.advance(1)
    _, second = services.credential_issue(worker_id="w1")
    assert "revoked 1 older credential" in run("workertoken", "revoke", "w1", "--previous")
    assert credential_of(first) is None
    assert credential_of(second)[1] == "w1"
    assert "cannot enrol again" in run("workertoken", "revoke", "w1")
    assert credential_of(second) is None
    with pytest.raises(CommandError, match="no credential to revoke"):
        run("workertoken", "revoke", "w1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("create", "embedded"), "reserved"),
        (("create", "bad id!"), "expected 1–128 characters"),
        (("create",), "usage: apiary worker token"),
        (("list", "w1"), "usage: apiary worker token"),
    ],
)
def test_worker_token_bad_input_is_a_clear_error(clock, args, message):
    with pytest.raises(CommandError, match=message):
        run("workertoken", *args)


def test_apiary_worker_token_routes_to_workertoken():
    assert cli.route(["apiary", "worker", "token", "list"]) == ["apiary", "workertoken", "list"]

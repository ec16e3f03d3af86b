"""Local mode end to end: `apiary run` and friends as real processes.

Every test starts the real commands (see tests/daemon.py), reads the
project's SQLite file, and waits on conditions with deadlines. Durations come
from each project's apiary.yaml: lease 3s, heartbeat 0.5s, polls 0.3s.
"""

import json
import shutil
import signal
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.daemon import (
    REPO,
    Daemon,
    Database,
    clean_env,
    command,
    group_alive,
    kill_groups,
    recorded_groups,
    run,
    wait_for,
)

pytestmark = pytest.mark.processes

HEARTBEAT = 0.5
RUN_TIMEOUT = 60.0  # a whole `--until-idle` run; generous for a loaded machine
STARTUP = 30.0  # from starting the daemon to its first step running
CANCEL_DEADLINE = 10 * HEARTBEAT  # the contract is one heartbeat interval; the rest is slack for load

SETTINGS = """\
project: {project}
settings:
  worker_capacity: {capacity}
  queue:
    lease_duration: 3s
    heartbeat_interval: {heartbeat}s
    worker_timeout: 3s
agents:
  - id: sh
    runner: shell
    command: cat
"""


def write_project(root: Path, body: str, *, tasks: dict[str, str] | None = None, capacity: int = 1) -> Path:
    """An apiary.yaml with the shared settings and agent `sh`, plus `body`; `tasks` go to tasks/."""
    (root / "tasks").mkdir(parents=True, exist_ok=True)
    for name, text in (tasks or {}).items():
        (root / "tasks" / name).write_text(text)
    config = root / "apiary.yaml"
    header = SETTINGS.format(project=root.name, capacity=capacity, heartbeat=HEARTBEAT)
    config.write_text(header + textwrap.dedent(body))
    return config


def one_step_project(root: Path, step: str, *, tasks=("a",), capacity: int = 1) -> Path:
    """One workflow `job` whose single step `work` runs `step`, one task file per name."""
    body = f"""\
    workflows:
      - id: job
        agent: sh
        steps:
          - id: work
            run: {json.dumps(step)}
    sources:
      - id: inbox
        type: directory
        path: tasks
        pattern: "*.md"
        poll_interval: 0.3s
        workflows: [job]
    """
    return write_project(root, body, tasks={f"{name}.md": f"# Task {name}\n" for name in tasks}, capacity=capacity)


@pytest.fixture
def daemons():
    """Start daemons with `daemons(config, *args)`; teardown kills what a failed test left running."""
    started: list[Daemon] = []

    def start(config: Path, *args: str, cwd: Path | None = None) -> Daemon:
        daemon = Daemon(config, *args, cwd=cwd)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        kill_groups(recorded_groups(daemon.config.parent / ".apiary"))


def db_of(config: Path) -> Database:
    return Database(config.parent / ".apiary" / "apiary.db")


# A workflow job's task and instance live in its payload (workflows/payload.py), not in queue columns.
JOB_COLUMNS = (
    "j.id, j.state, json_extract(j.payload, '$.task.id') AS task_id,"
    " json_extract(j.payload, '$.instance_id') AS instance_id,"
    " json_extract(j.payload, '$.task.generation') AS generation, j.attempt_count"
)


def jobs(db: Database) -> list:
    return db.rows(f"SELECT {JOB_COLUMNS} FROM queue_job j ORDER BY j.id")


def job_of(db: Database, instance: int):
    """The job of an instance, found through the instance's own `job_id` (and its payload must agree)."""
    rows = db.rows(
        f"SELECT {JOB_COLUMNS} FROM queue_job j JOIN workflows_workflowinstance i ON i.job_id = j.id WHERE i.id = ?",
        instance,
    )
    assert all(row["instance_id"] == instance for row in rows), [tuple(r) for r in rows]
    return rows[0] if rows else None


def instance_state(db: Database, instance: int) -> str | None:
    """An instance's state is its job's (the instance row keeps no copy)."""
    return db.value(
        "SELECT j.state FROM workflows_workflowinstance i JOIN queue_job j ON j.id = i.job_id WHERE i.id = ?", instance
    )


def attempts_per_job(db: Database) -> dict[int, int]:
    return {row[0]: row[1] for row in db.rows("SELECT job_id, count(*) FROM queue_attempt GROUP BY job_id")}


def running_step(db: Database):
    return db.rows("SELECT instance_id, attempt_number, step_id FROM workflows_steprun WHERE status = 'running'")


def wait_running(daemon: Daemon, db: Database, state_dir: Path) -> tuple[int, int]:
    """Wait until a step runs and its process group is recorded; (instance id, pgid)."""
    rows = wait_for(lambda: running_step(db), timeout=STARTUP, what="a running step", daemon=daemon)
    groups = wait_for(
        lambda: recorded_groups(state_dir), timeout=STARTUP, what="a recorded process group", daemon=daemon
    )
    assert len(rows) == 1 and len(groups) == 1, (rows, groups)
    assert group_alive(groups[0])
    return rows[0]["instance_id"], groups[0]


def wait_group_gone(pgid: int, *, timeout: float) -> None:
    wait_for(lambda: not group_alive(pgid), timeout=timeout, what=f"process group {pgid} to end")


# ----------------------------------------------------------------------------- 1. the example


def test_example_processes_every_item_exactly_once_and_redispatches_an_edited_file(tmp_path):
    root = tmp_path / "hello"
    shutil.copytree(REPO / "examples" / "hello", root, ignore=shutil.ignore_patterns(".apiary"))
    config = root / "apiary.yaml"
    db = db_of(config)

    first = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert first.returncode == 0, first.stderr
    rows = jobs(db)
    assert len(rows) == 3
    assert {row["state"] for row in rows} == {"succeeded"}
    assert {row["attempt_count"] for row in rows} == {1}
    assert attempts_per_job(db) == {row["id"]: 1 for row in rows}
    tasks = {row["item_key"]: row["generation"] for row in db.rows("SELECT item_key, generation FROM workflows_task")}
    assert tasks == {"fix-login.md": 1, "flaky-test.md": 1, "update-docs.md": 1}
    for row in rows:
        instance = row["instance_id"]
        assert instance_state(db, instance) == "succeeded"
        steps = db.rows(
            "SELECT step_id, status, attempt_number, exit_code FROM workflows_steprun WHERE instance_id = ? ORDER BY id",
            instance,
        )
        assert [tuple(s) for s in steps] == [(s, "succeeded", 1, 0) for s in ("announce", "shout", "record")]
        for step in ("announce", "shout", "record"):
            assert (root / ".apiary" / "logs" / str(instance) / f"{step}.log").is_file()
        # The prompt step went through the shell agent (`tr` to upper case).
        assert "PLEASE SHOUT THIS TITLE" in (root / ".apiary" / "logs" / str(instance) / "shout.log").read_text()

    again = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert again.returncode == 0, again.stderr
    assert "dispatch:" not in again.stderr
    assert [tuple(r) for r in jobs(db)] == [tuple(r) for r in rows]
    assert db.value("SELECT count(*) FROM queue_attempt") == 3

    with open(root / "tasks" / "flaky-test.md", "a") as edited:
        edited.write("\nNow it fails once in ten runs.\n")
    third = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert third.returncode == 0, third.stderr
    tasks = {row["item_key"]: row["generation"] for row in db.rows("SELECT item_key, generation FROM workflows_task")}
    assert tasks == {"fix-login.md": 1, "flaky-test.md": 2, "update-docs.md": 1}
    after = jobs(db)
    assert len(after) == 4
    new = after[-1]
    flaky = db.value("SELECT id FROM workflows_task WHERE item_key = 'flaky-test.md'")
    assert (new["task_id"], new["generation"], new["state"], new["attempt_count"]) == (flaky, 2, "succeeded", 1)
    assert db.value("SELECT count(*) FROM queue_attempt") == 4


# ----------------------------------------------------------------------------- 2. a command source


def test_command_source_redispatches_changed_items_and_survives_a_failing_command(tmp_path, daemons):
    root = tmp_path / "feed"
    body = """\
    workflows:
      - id: echo
        agent: sh
        steps:
          - id: show
            run: 'echo "$APIARY_TASK_ITEM_KEY generation $APIARY_TASK_GENERATION"'
    sources:
      - id: feed
        type: command
        # Relative paths: the command runs in the config's folder, wherever the daemon was started.
        command: "if [ -e fail ]; then echo feed-is-broken >&2; exit 3; fi; cat items.json"
        poll_interval: 0.3s
        workflows: [echo]
    """
    config = write_project(root, body)
    items = root / "items.json"

    def publish(*entries: tuple[str, str]) -> None:
        items.write_text(
            json.dumps([{"id": key, "title": f"Item {key}", "updated_at": stamp} for key, stamp in entries])
        )

    def generations() -> dict[str, int]:
        return {r["item_key"]: r["generation"] for r in db.rows("SELECT item_key, generation FROM workflows_task")}

    def succeeded(count: int):
        rows = jobs(db)
        return len(rows) == count and all(r["state"] == "succeeded" for r in rows)

    db = db_of(config)
    publish(("a", "1"), ("b", "1"), ("c", "1"))
    daemon = daemons(config, cwd=tmp_path)  # started elsewhere on purpose
    wait_for(lambda: succeeded(3), timeout=RUN_TIMEOUT, what="3 jobs succeeded", daemon=daemon)
    assert generations() == {"a": 1, "b": 1, "c": 1}

    publish(("a", "1"), ("b", "2"), ("c", "1"))
    wait_for(lambda: succeeded(4), timeout=RUN_TIMEOUT, what="the changed item's job", daemon=daemon)
    assert generations() == {"a": 1, "b": 2, "c": 1}
    new = jobs(db)[-1]
    assert new["generation"] == 2
    assert db.value("SELECT item_key FROM workflows_task WHERE id = ?", new["task_id"]) == "b"
    assert db.value("SELECT output_tail FROM workflows_steprun WHERE instance_id = ?", new["instance_id"]).strip() == (
        "b generation 2"
    )

    (root / "fail").touch()
    wait_for(lambda: "feed-is-broken" in daemon.output(), timeout=STARTUP, what="the stderr tail logged", daemon=daemon)
    (root / "fail").unlink()
    items.write_text('[{"id": "a", "updated_at": ')
    wait_for(lambda: "malformed" in daemon.output(), timeout=STARTUP, what="malformed output logged", daemon=daemon)
    assert daemon.proc.poll() is None
    assert generations() == {"a": 1, "b": 2, "c": 1}  # nothing dropped, nothing redispatched
    assert len(jobs(db)) == 4

    publish(("a", "1"), ("b", "2"), ("c", "1"), ("d", "1"))
    wait_for(lambda: succeeded(5), timeout=RUN_TIMEOUT, what="the new item's job after recovery", daemon=daemon)
    assert generations() == {"a": 1, "b": 2, "c": 1, "d": 1}

    daemon.send(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0


# ----------------------------------------------------------------------------- 3. cancel


def test_cancel_stops_a_running_step_and_its_whole_process_group(tmp_path, daemons):
    config = one_step_project(tmp_path / "cancel", "sleep 60")
    state, db = config.parent / ".apiary", db_of(config)
    daemon = daemons(config)
    instance, pgid = wait_running(daemon, db, state)

    cancelled = run("cancel", str(instance), config=config)
    assert cancelled.returncode == 0, cancelled.stderr
    wait_for(
        lambda: (
            job_of(db, instance)["state"] == "cancelled"
            and instance_state(db, instance) == "cancelled"
        ),
        timeout=CANCEL_DEADLINE,
        what="job and instance cancelled",
        daemon=daemon,
    )
    wait_group_gone(pgid, timeout=CANCEL_DEADLINE)
    assert db.value("SELECT status FROM workflows_steprun WHERE instance_id = ?", instance) == "cancelled"
    assert recorded_groups(state) == []

    daemon.send(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0


# ----------------------------------------------------------------------------- 4. SIGKILL


def test_a_successor_ends_the_steps_a_killed_daemon_left_and_runs_the_job_again(tmp_path, daemons):
    step = 'if [ "$APIARY_ATTEMPT" = 1 ]; then sleep 60; fi; echo done'
    config = one_step_project(tmp_path / "crash", step)
    state, db = config.parent / ".apiary", db_of(config)
    first = daemons(config)
    instance, pgid = wait_running(first, db, state)

    first.send(signal.SIGKILL)  # the daemon only: the step has its own group
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert group_alive(pgid), "the step should outlive the SIGKILLed daemon as an orphan"

    second = daemons(config, "--until-idle")
    assert second.wait(timeout=RUN_TIMEOUT) == 0, second.tail()
    wait_group_gone(pgid, timeout=10)
    assert recorded_groups(state) == []
    job = job_of(db, instance)
    assert (job["state"], job["attempt_count"]) == ("succeeded", 2)
    last = db.rows(
        "SELECT status, output_tail FROM workflows_steprun WHERE instance_id = ? AND attempt_number = 2", instance
    )[0]
    assert (last["status"], last["output_tail"].strip()) == ("succeeded", "done")


# ----------------------------------------------------------------------------- 5. SIGTERM


def test_sigterm_drains_a_running_step_to_success_and_claims_nothing_new(tmp_path, daemons):
    config = one_step_project(tmp_path / "drain", "sleep 2", tasks=("a", "b"), capacity=1)
    state, db = config.parent / ".apiary", db_of(config)
    daemon = daemons(config)
    instance, _ = wait_running(daemon, db, state)
    wait_for(lambda: len(jobs(db)) == 2, timeout=STARTUP, what="both jobs dispatched", daemon=daemon)

    daemon.send(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0, daemon.tail()
    by_instance = {row["instance_id"]: row for row in jobs(db)}
    running = by_instance.pop(instance)
    (waiting,) = by_instance.values()
    assert (running["state"], running["attempt_count"]) == ("succeeded", 1)
    assert db.value("SELECT status FROM workflows_steprun WHERE instance_id = ?", instance) == "succeeded"
    assert (waiting["state"], waiting["attempt_count"]) == ("queued", 0)  # drained: never claimed


def test_a_second_signal_stops_the_running_step_and_cancels_its_job(tmp_path, daemons):
    config = one_step_project(tmp_path / "stop", "sleep 60")
    state, db = config.parent / ".apiary", db_of(config)
    daemon = daemons(config)
    instance, pgid = wait_running(daemon, db, state)

    daemon.send(signal.SIGTERM)
    wait_for(lambda: "draining" in daemon.output(), timeout=STARTUP, what="the first signal handled", daemon=daemon)
    daemon.send(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0, daemon.tail()
    wait_group_gone(pgid, timeout=CANCEL_DEADLINE)
    assert job_of(db, instance)["state"] == "cancelled"
    assert instance_state(db, instance) == "cancelled"
    assert db.value("SELECT status FROM workflows_steprun WHERE instance_id = ?", instance) == "cancelled"


# ----------------------------------------------------------------------------- 6. invalid config

VALID = {
    "project": "broken",
    "settings": {"queue": {"lease_duration": "3s", "heartbeat_interval": "0.5s", "worker_timeout": "3s"}},
    "agents": [{"id": "sh", "runner": "shell", "command": "cat"}],
    "workflows": [{"id": "job", "agent": "sh", "steps": [{"id": "work", "run": "true"}]}],
    "sources": [{"id": "inbox", "type": "directory", "path": "tasks", "workflows": ["job"]}],
}

# (kind, change to VALID, the key path its error must name, what else that line must say)
INVALID = [
    ("unknown key", lambda c: c["settings"]["queue"].update(lease="3s"), "settings.queue.lease", "unknown key"),
    (
        "bad duration",
        lambda c: c["settings"]["queue"].update(lease_duration="soon"),
        "settings.queue.lease_duration",
        "'soon'",
    ),
    ("unknown agent", lambda c: c["workflows"][0].update(agent="ghost"), "workflows[0].agent", "'ghost'"),
    ("unknown runner", lambda c: c["agents"][0].update(runner="gpt"), "agents[0].runner", "'gpt'"),
    (
        "listen without token",
        lambda c: c["settings"]["queue"].update(listen="127.0.0.1:8799"),
        "settings.queue.worker_token",
        "listen",
    ),
    ("unset variable", lambda c: c.update(project="${APIARY_E2E_NEVER_SET}"), "project", "APIARY_E2E_NEVER_SET"),
]


def test_each_kind_of_invalid_config_exits_2_naming_the_key_path(tmp_path):
    """The loader reports every problem of a file in one pass, so one file
    carrying every kind checks each of them with a single start-up (seconds
    each on a loaded machine): each must be its own error line naming its key
    path — not a warning, not a traceback. Two files with one problem each
    (one found while interpolating, one by a cross-check) show that a single
    problem is enough to stop `apiary run` with exit 2 before it touches anything."""
    cases = {"all": INVALID, "unset-variable": [INVALID[-1]], "listen-without-token": [INVALID[-2]]}
    started = {}
    for name, kinds in cases.items():
        root = tmp_path / name
        (root / "tasks").mkdir(parents=True)
        raw = json.loads(json.dumps(VALID))
        for _, change, _, _ in kinds:
            change(raw)
        (root / "apiary.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        started[name] = subprocess.Popen(  # all at once: they are independent
            command("runapiary", "--config", str(root / "apiary.yaml"), "--until-idle"),
            cwd=root,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    problems = []
    for name, proc in started.items():
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT)
        if proc.returncode != 2 or "Traceback" in stderr:
            problems.append(f"{name}: exit {proc.returncode}, expected 2 and no traceback; stderr:\n{stderr}")
            continue
        for kind, _, key_path, detail in cases[name]:
            # The loader's format is `<file>: <key path>: <what was expected>`.
            lines = [line for line in stderr.splitlines() if f"apiary.yaml: {key_path}: " in line]
            if not any(detail in line for line in lines):
                problems.append(f"{name}: no error line for {kind} ({key_path}: …{detail}…); stderr:\n{stderr}")
        if (tmp_path / name / ".apiary").exists():
            problems.append(f"{name}: the state folder was created although the config is invalid")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- 7. blocked


def test_a_job_for_a_pool_no_worker_serves_is_listed_as_blocked_with_the_reason(tmp_path, daemons):
    body = """\
      - id: builder
        runner: shell
        command: cat
        worker_pool: build
    workflows:
      - id: build
        agent: builder
        steps:
          - id: compile
            run: echo compiled
    sources:
      - id: inbox
        type: directory
        path: tasks
        pattern: "*.md"
        poll_interval: 0.3s
        workflows: [build]
    """
    config = write_project(tmp_path / "blocked", body, tasks={"a.md": "# Build it\n"})
    db = db_of(config)
    daemon = daemons(config)
    wait_for(
        lambda: jobs(db) and db.value("SELECT count(*) FROM queue_worker WHERE worker_id = 'embedded'"),
        timeout=STARTUP,
        what="the job dispatched and the embedded worker registered",
        daemon=daemon,
    )
    (job,) = jobs(db)

    with ThreadPoolExecutor() as pool:  # two independent start-ups, side by side
        status, text = pool.map(lambda args: run("status", *args, config=config), [("--json",), ()])
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["jobs"]["queued"] == 1
    blocked = {entry["job_id"]: entry["reason"] for entry in doc["blocked"]}
    assert job["id"] in blocked, doc
    assert "pool" in blocked[job["id"]] and "build" in blocked[job["id"]]

    assert text.returncode == 0, text.stderr
    blocked_section = text.stdout.split("Blocked", 1)[1]
    assert blocked[job["id"]] in blocked_section

    daemon.send(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0
    assert (jobs(db)[0]["state"], jobs(db)[0]["attempt_count"]) == ("queued", 0)

    # --until-idle does not wait forever for it: exit 3, naming the job and why.
    idle = run("runapiary", "--until-idle", config=config)
    assert idle.returncode == 3, idle.stderr
    assert f"blocked: job {job['id']}: no worker in pool build" in idle.stderr


# ----------------------------------------------------------------------------- 8. task add


def test_a_task_added_by_hand_is_run_by_the_next_run(tmp_path):
    body = """\
    workflows:
      - id: hello
        agent: sh
        steps:
          - id: say
            run: 'echo "title=$APIARY_TASK_TITLE"'
    """
    config = write_project(tmp_path / "manual", body)
    db = db_of(config)
    title = "Water the plants; rm -rf / # not a command"

    added = run("task", "add", "--source", "manual", "--title", title, "--workflow", "hello", config=config)
    assert added.returncode == 0, added.stderr
    (task,) = db.rows("SELECT id, source, title FROM workflows_task")
    assert (task["source"], task["title"]) == ("manual", title)
    assert [(j["task_id"], j["state"]) for j in jobs(db)] == [(task["id"], "queued")]

    ran = run("runapiary", "--until-idle", config=config, timeout=RUN_TIMEOUT)
    assert ran.returncode == 0, ran.stderr
    (job,) = jobs(db)
    assert job["state"] == "succeeded"
    tail = db.value("SELECT output_tail FROM workflows_steprun WHERE instance_id = ?", job["instance_id"])
    assert tail.strip() == f"title={title}"

"""apiary.yaml loading and validation (workflows.config) and `apiary check`.

No database: the loader is pure, and the check command must work before any migration.
"""

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from django.core.management import call_command

from jobqueue.types import Retry
from workflows import config as cfg

REPO = Path(__file__).resolve().parent.parent

# DESIGN §3.2, verbatim, followed by the sources/workflows shapes of issue 3.
DESIGN_EXAMPLE = """\
settings:
  concurrency: 2            # limit on leased jobs per project unless queue.concurrency.default_project is set
  worker_capacity: 1        # embedded worker capacity (default 1)
  queue:
    listen: 0.0.0.0:8080    # expose the worker protocol; requires worker_token
    worker_token: ${APIARY_WORKER_TOKEN}   # ${VAR} and ${VAR:-default} interpolation
    embedded_worker: true   # set false only once a remote worker is available
    lease_duration: 30s
    heartbeat_interval: 10s # must be comfortably below lease_duration
    worker_timeout: 30s     # a worker is stale after this long without heartbeat
    concurrency:            # 0 or absent = unlimited; keyed value overrides default
      default_project: 12
      default_source: 0
      default_agent: 4
      default_runner: 0
      default_pool: 0
      projects: {}
      sources: {}
      agents: {deployer: 1}
      runners: {codex-cli: 6}
      pools: {production: 1}
agents:
  - id: engineer
    runner: codex           # adapter codex-cli; claude -> claude-code; shell -> shell
    model: gpt-5
    worker_pool: build
    requires_labels: [linux]
    requires_capabilities: [docker]
    workspace_affinity: true
  - id: deployer
    runner: shell
    command: [deploy, --now]
    worker_pool: production
    env: {STAGE: prod, RETRIES: 3}
workflows:
  - id: fix
    agent: engineer
    timeout: 1h30m
    priority: 5
    retry: {max_attempts: 3, backoff: 10s, backoff_max: 5m}
    steps:
      - id: plan
        prompt: "Plan: {{ task.title }}"
      - id: test
        run: make test
        timeout: 10m
        env: {CI: "1"}
        continue_on_error: true
  - id: deploy
    agent: deployer
    steps:
      - id: go
        prompt: ship it
sources:
  - id: inbox
    type: directory
    path: tasks
    pattern: "*.md"
    poll_interval: 2s
    redispatch_on_change: true
    workflows: [fix, deploy]
  - id: feed
    type: command
    command: "cat issues.jsonl"
    workflows: [fix]
"""

TOKEN = "t" * 40


def write(directory: Path, text: str, name: str = "apiary.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def errors_of(path: Path, environ: dict | None = None) -> list[str]:
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.load(path, environ=environ or {})
    return caught.value.errors


# --------------------------------------------------------------------------- the documented example


def test_design_example_parses_with_the_right_values(tmp_path):
    (tmp_path / "tasks").mkdir()
    path = write(tmp_path, DESIGN_EXAMPLE)
    config = cfg.load(path, environ={"APIARY_WORKER_TOKEN": TOKEN})

    assert config.path == path
    assert config.project == tmp_path.name
    assert config.state_dir == tmp_path / ".apiary"
    assert config.settings.concurrency == 2
    assert config.settings.worker_capacity == 1
    q = config.settings.queue
    assert (q.listen, q.worker_token, q.embedded_worker) == ("0.0.0.0:8080", TOKEN, True)
    assert (q.lease_duration, q.heartbeat_interval, q.worker_timeout, q.max_attempts) == (30.0, 10.0, 30.0, 5)
    assert q.limits.defaults == {"project": 12, "source": 0, "agent": 4, "runner": 0, "pool": 0}
    assert q.limits.overrides == {
        "project": {},
        "source": {},
        "agent": {"deployer": 1},
        "runner": {"codex-cli": 6},
        "pool": {"production": 1},
    }
    assert q.limits.limit("project", config.project) == 12
    assert q.limits.limit("agent", "deployer") == 1
    assert q.limits.limit("agent", "engineer") == 4
    assert q.limits.limit("runner", "codex-cli") == 6

    engineer = config.agents["engineer"]
    assert engineer == cfg.AgentConfig(
        id="engineer",
        runner="codex",
        adapter="codex-cli",
        model="gpt-5",
        command=None,
        worker_pool="build",
        requires_labels=("linux",),
        requires_capabilities=("docker",),
        workspace_affinity=True,
        env={},
    )
    deployer = config.agents["deployer"]
    assert (deployer.adapter, deployer.command, deployer.worker_pool) == ("shell", ("deploy", "--now"), "production")
    assert deployer.env == {"STAGE": "prod", "RETRIES": "3"}
    assert deployer.workspace_affinity is False

    fix = config.workflows["fix"]
    assert (fix.agent, fix.timeout, fix.priority) == ("engineer", 5400.0, 5)
    assert fix.retry == Retry(max_attempts=3, backoff=10.0, backoff_max=300.0)
    assert fix.steps == (
        cfg.StepConfig(
            id="plan", prompt="Plan: {{ task.title }}", run=None, timeout=None, env={}, continue_on_error=False
        ),
        cfg.StepConfig(id="test", prompt=None, run="make test", timeout=600.0, env={"CI": "1"}, continue_on_error=True),
    )
    deploy = config.workflows["deploy"]
    assert (deploy.timeout, deploy.retry, deploy.priority) == (None, Retry(), 0)

    inbox = config.sources["inbox"]
    assert inbox == cfg.SourceConfig(
        id="inbox",
        type="directory",
        workflows=("fix", "deploy"),
        poll_interval=2.0,
        path=tmp_path / "tasks",
        pattern="*.md",
        redispatch_on_change=True,
        command=None,
    )
    feed = config.sources["feed"]
    assert (feed.type, feed.command, feed.poll_interval, feed.path, feed.workflows) == (
        "command",
        "cat issues.jsonl",
        30.0,
        None,
        ("fix",),
    )
    assert config.warnings == ()

    qc = config.queue_config()
    assert (qc.lease_duration, qc.heartbeat_interval, qc.worker_timeout, qc.max_attempts) == (30.0, 10.0, 30.0, 5)
    assert qc.limits is q.limits


def test_minimal_file_gets_every_default(tmp_path):
    path = write(tmp_path, "agents: []\n")
    config = cfg.load(path, environ={})
    assert config.project == tmp_path.name
    assert config.settings == cfg.Settings(concurrency=0, worker_capacity=1, queue=config.settings.queue)
    q = config.settings.queue
    assert (q.listen, q.worker_token, q.embedded_worker) == (None, None, True)
    assert (q.lease_duration, q.heartbeat_interval, q.worker_timeout, q.max_attempts) == (30.0, 10.0, 30.0, 5)
    # No limit at all, the project's included: the workers' capacity governs.
    assert q.limits.defaults == {"project": 0, "source": 0, "agent": 0, "runner": 0, "pool": 0}
    assert q.limits.limit("project", config.project) == 0
    assert q.limits.active_dimensions() == ()
    assert q.listener == cfg.schema.ListenerSettings(processes=2, request_timeout=10.0, idle_timeout=60.0)
    assert (config.agents, config.workflows, config.sources) == ({}, {}, {})


def test_worker_identity_settings_are_read_and_reach_the_queue(tmp_path):
    old = "o" * 40
    changes = {
        "settings.queue.worker_token": TOKEN,
        "settings.queue.previous_worker_tokens": [old],
        "settings.queue.enrollment": False,
        "settings.queue.claim_rate": 5,
        "settings.queue.forget_workers_after": "2h",
    }
    config = cfg.load(write_changed(tmp_path, changes), environ={})
    q = config.settings.queue
    assert (q.previous_worker_tokens, q.enrollment, q.claim_rate, q.forget_workers_after) == ((old,), False, 5.0, 7200.0)
    queue = config.queue_config()
    assert (queue.enrollment, queue.claim_rate, queue.claim_burst, queue.forget_workers_after) == (False, 5.0, 10, 7200.0)


def test_worker_identity_defaults(tmp_path):
    queue = cfg.load(write_changed(tmp_path, {}), environ={}).queue_config()
    assert (queue.enrollment, queue.claim_rate, queue.claim_burst, queue.forget_workers_after) == (True, 20.0, 40, 86400.0)


def test_listener_settings_are_read(tmp_path):
    changes = {"settings.queue.listener": {"processes": 4, "request_timeout": "5s", "idle_timeout": "2m"}}
    config = cfg.load(write_changed(tmp_path, changes), environ={})
    assert config.settings.queue.listener == cfg.schema.ListenerSettings(4, 5.0, 120.0)


ISSUE_10_EXAMPLE = """\
agents: [{id: engineer, runner: shell, command: cat}]
workflows:
  - id: fix
    agent: engineer
    steps:
      - id: plan
        prompt: "Plan a fix for {{ task.title }}"
      - id: implement
        prompt: "Implement: {{ steps.plan.output }}"
      - id: open-pr
        publish: true
        run: ./open-pr.sh
      - id: split
        spawn: true
        run: ./split-into-subtasks.sh
    hooks:
      on_success: [{run: "./notify.sh done"}]
      on_failure: [{run: "./notify.sh failed"}]
      on_cancel:  [{run: "./notify.sh cancelled"}]
"""


def test_the_issue_10_example_parses_publish_spawn_and_hooks(tmp_path):
    fix = cfg.load(write(tmp_path, ISSUE_10_EXAMPLE), environ={}).workflows["fix"]
    assert [(s.id, s.publish, s.spawn) for s in fix.steps] == [
        ("plan", False, False),
        ("implement", False, False),
        ("open-pr", True, False),
        ("split", False, True),
    ]
    # Keyed by the terminal job state each hook runs for.
    assert fix.hooks == {
        "succeeded": (cfg.StepConfig(id="hook-1", run="./notify.sh done"),),
        "failed": (cfg.StepConfig(id="hook-1", run="./notify.sh failed"),),
        "cancelled": (cfg.StepConfig(id="hook-1", run="./notify.sh cancelled"),),
    }


def test_hook_steps_take_ids_timeouts_and_env_and_only_given_outcomes_are_kept(tmp_path):
    hooks = {"on_failure": [{"run": "a"}, {"id": "page", "run": "b", "timeout": "30s", "env": {"N": 1}}, {"run": "c"}]}
    workflow = cfg.load(write_changed(tmp_path, {"workflows[0].hooks": hooks}), environ={}).workflows["build"]
    assert workflow.hooks == {
        "failed": (
            cfg.StepConfig(id="hook-1", run="a"),
            cfg.StepConfig(id="page", run="b", timeout=30.0, env={"N": "1"}),
            cfg.StepConfig(id="hook-3", run="c"),
        )
    }
    assert all(not (s.publish or s.spawn) for s in workflow.steps)


def test_a_workflow_without_hooks_has_none(tmp_path):
    changes = {"workflows[0].hooks": None, "workflows[0].steps[0].publish": False}
    workflow = cfg.load(write_changed(tmp_path, changes), environ={}).workflows["build"]
    assert workflow.hooks == {}
    assert workflow.steps[0].publish is False


def test_the_readme_apiary_yaml_example_loads(tmp_path):
    block = (REPO / "README.md").read_text().split("### apiary.yaml", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    environ = {"APIARY_WORKER_TOKEN": TOKEN, "APIARY_OLD_WORKER_TOKEN": "o" * 40, "APIARY_METRICS_TOKEN": "m" * 40}
    config = cfg.load(write(tmp_path, block), environ=environ)
    assert config.settings.metrics == cfg.MetricsSettings(listen="127.0.0.1:9464", token="m" * 40)
    fix = config.workflows["fix"]
    assert [s.id for s in fix.steps if s.publish or s.spawn] == ["open-pr", "split"]
    assert set(fix.hooks) == {"succeeded", "failed", "cancelled"}


def test_config_objects_are_frozen(tmp_path):
    config = cfg.load(write(tmp_path, "project: p\n"), environ={})
    with pytest.raises(AttributeError):
        config.project = "other"  # type: ignore[misc]


# --------------------------------------------------------------------------- limits precedence


@pytest.mark.parametrize(
    ("settings", "project_limit"),
    [
        # omitted means no project limit, as every omitted limit
        ({}, 0),
        ({"concurrency": 2}, 2),
        ({"concurrency": 7}, 7),
        ({"concurrency": 0}, 0),
        ({"concurrency": 7, "queue": {"concurrency": {"default_project": 3}}}, 3),
        # an explicit 0 means unlimited and still wins over settings.concurrency
        ({"concurrency": 7, "queue": {"concurrency": {"default_project": 0}}}, 0),
        ({"queue": {"concurrency": {"default_project": 3}}}, 3),
        ({"queue": {"concurrency": {"default_agent": 4}}}, 0),
    ],
)
def test_project_limit_precedence(tmp_path, settings, project_limit):
    path = write(tmp_path, yaml.safe_dump({"project": "p", "settings": settings}))
    limits = cfg.load(path, environ={}).queue_config().limits
    assert limits.defaults["project"] == project_limit
    assert limits.limit("project", "p") == project_limit


def test_keyed_project_override_beats_both_defaults(tmp_path):
    text = yaml.safe_dump(
        {"project": "p", "settings": {"concurrency": 7, "queue": {"concurrency": {"projects": {"p": 1}}}}}
    )
    limits = cfg.load(write(tmp_path, text), environ={}).queue_config().limits
    assert limits.limit("project", "p") == 1


# --------------------------------------------------------------------------- interpolation

INTERPOLATED = """\
project: ${PROJECT:-fallback}
settings:
  worker_capacity: ${CAPACITY:-3}
  queue:
    listen: ${LISTEN:-}
    worker_token: ${TOKEN:-}
    embedded_worker: ${EMBEDDED:-true}
    lease_duration: ${LEASE:-1m}
agents:
  - id: sh
    runner: shell
    command: "echo $${NOT_EXPANDED} $HOME $$ ${GREETING:-hello world}"
    env: {HOMEDIR: "${HOME_DIR}/x"}
"""


def test_interpolation_uses_the_environment_then_the_default(tmp_path):
    path = write(tmp_path, INTERPOLATED)
    config = cfg.load(
        path, environ={"HOME_DIR": "/home/a", "CAPACITY": "4", "EMBEDDED": "false", "LISTEN": "h:1", "TOKEN": TOKEN}
    )
    assert config.project == "fallback"
    assert config.settings.worker_capacity == 4
    assert config.settings.queue.embedded_worker is False
    assert config.settings.queue.listen == "h:1"
    assert config.settings.queue.lease_duration == 60.0
    sh = config.agents["sh"]
    # `$${` is a literal `${`; a bare `$` (shell variables, `$$`) is left alone.
    assert sh.command == "echo ${NOT_EXPANDED} $HOME $$ hello world"
    assert sh.env == {"HOMEDIR": "/home/a/x"}
    assert type(sh.command) is str and type(config.project) is str


def test_interpolation_default_applies_to_an_empty_variable_and_set_value_wins(tmp_path):
    path = write(tmp_path, INTERPOLATED)
    config = cfg.load(path, environ={"HOME_DIR": "/h", "PROJECT": "", "GREETING": "hi"})
    assert config.project == "fallback"
    assert config.agents["sh"].command.endswith("$$ hi")
    assert config.settings.queue.listen is None  # `${LISTEN:-}` = listening off


def test_unset_variable_without_default_names_the_variable_and_the_key_path(tmp_path):
    path = write(tmp_path, INTERPOLATED)
    [error] = errors_of(path, environ={})
    assert error.startswith(f"{path}: agents[0].env.HOMEDIR: environment variable HOME_DIR is not set")


SECRET = "s3cr3t-Tok'en\\with\"quotes-0123456789abcdef"  # quotes and a backslash: repr and JSON forms differ
MINIMAL = """\
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: feed, type: command, command: "true", workflows: [w]}]
"""


# (a line added to MINIMAL, the key path its error names): each value comes from ${APIARY_WORKER_TOKEN}.
SECRET_IN_THE_WRONG_PLACE = [
    ("settings: {queue: {lease_duration: '${APIARY_WORKER_TOKEN}'}}", "settings.queue.lease_duration"),
    ("settings: {queue: {max_attempts: '${APIARY_WORKER_TOKEN}'}}", "settings.queue.max_attempts"),
    ("settings: {queue: {embedded_worker: '${APIARY_WORKER_TOKEN}'}}", "settings.queue.embedded_worker"),
    ("settings: {queue: {listen: 'x-${APIARY_WORKER_TOKEN}-y'}}", "settings.queue.listen"),
    ("settings: {worker_capacity: '${APIARY_WORKER_TOKEN}'}", "settings.worker_capacity"),
    ("project: '${APIARY_WORKER_TOKEN}'", "project"),
    ("settings: {queue: {concurrency: {agents: {'sh': '${APIARY_WORKER_TOKEN}'}}}}", "settings.queue.concurrency.agents.sh"),
]


@pytest.mark.parametrize("line, key", SECRET_IN_THE_WRONG_PLACE)
def test_an_error_about_an_interpolated_value_names_the_variable_never_the_value(tmp_path, line, key):
    path = write(tmp_path, MINIMAL + line + "\n")
    errors = errors_of(path, environ={"APIARY_WORKER_TOKEN": SECRET})
    text = "\n".join(errors)
    for form in (SECRET, repr(SECRET)[1:-1], SECRET[:12], SECRET[-12:]):
        assert form not in text
    [error] = [e for e in errors if f": {key}: " in e]
    assert "${APIARY_WORKER_TOKEN}" in error


def test_a_warning_about_an_interpolated_value_names_the_variable_never_the_value(tmp_path):
    text = MINIMAL.replace("sources: [", "sources: [{id: inbox, type: directory, path: '${TASKS}', workflows: [w]}, ")
    config = cfg.load(write(tmp_path, text), environ={"TASKS": "/nowhere/" + SECRET})
    [warning] = config.warnings
    assert "sources[0].path" in warning and "${TASKS}" in warning and SECRET not in warning


def test_unset_worker_token_reports_the_variable_only(tmp_path):
    path = write(tmp_path, DESIGN_EXAMPLE)
    (tmp_path / "tasks").mkdir()
    # Not also "worker_token required when listen is set": one cause, one message.
    assert errors_of(path, environ={}) == [
        f"{path}: settings.queue.worker_token: environment variable APIARY_WORKER_TOKEN is not set "
        "(give a default with ${APIARY_WORKER_TOKEN:-value}, or write $${APIARY_WORKER_TOKEN} "
        "for a literal '${APIARY_WORKER_TOKEN}')"
    ]


@pytest.mark.parametrize("value", ["${1BAD}", "${NAME:-x", "${}", "${A-b}"])
def test_malformed_interpolation_is_an_error(tmp_path, value):
    path = write(tmp_path, yaml.safe_dump({"project": value}))
    [error] = errors_of(path, environ={"A": "a", "NAME": "n"})
    assert error.startswith(f"{path}: project: ")
    assert "expected ${NAME} or ${NAME:-default}" in error


def test_interpolated_text_is_still_type_checked(tmp_path):
    path = write(tmp_path, "settings:\n  worker_capacity: ${CAP}\n")
    [error] = errors_of(path, environ={"CAP": "lots"})
    # The variable, not its value: an interpolated value may be a secret.
    assert error == f"{path}: settings.worker_capacity: expected an integer ≥ 1, got '${{CAP}}'"


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("1.5s", 1.5),
        ("2d", 172800.0),
        ("1m 30s", 90.0),
        ("45", 45.0),
        ("0.5", 0.5),
        (10, 10.0),
        (2.5, 2.5),
        (0, 0.0),
    ],
)
def test_parse_duration(value, seconds):
    assert cfg.parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "soon", "5 minutes", "10x", "s", "-5s", -1, True, None, [1], "1h-5m", "inf"])
def test_parse_duration_rejects_with_a_clear_message(value):
    with pytest.raises(ValueError, match=r"expected .*duration"):
        cfg.parse_duration(value)


# --------------------------------------------------------------------------- invalid configs

DELETE = object()

BASE = {
    "project": "demo",
    "settings": {
        "concurrency": 2,
        "worker_capacity": 1,
        "queue": {
            "lease_duration": "30s",
            "heartbeat_interval": "10s",
            "worker_timeout": "30s",
            "concurrency": {"agents": {"coder": 1}},
        },
    },
    "agents": [
        {"id": "sh", "runner": "shell", "command": "cat"},
        {"id": "coder", "runner": "codex", "model": "gpt-5", "requires_labels": ["linux"]},
    ],
    "workflows": [
        {
            "id": "build",
            "agent": "sh",
            "retry": {"max_attempts": 2, "backoff": "5s"},
            "steps": [{"id": "one", "run": "true"}, {"id": "two", "prompt": "hi"}, {"id": "three", "run": "echo"}],
        }
    ],
    "sources": [
        {"id": "inbox", "type": "directory", "path": "tasks", "workflows": ["build"]},
        {"id": "feed", "type": "command", "command": ["echo", "[]"], "workflows": ["build"]},
    ],
}


def _parse_path(path: str) -> list:
    parts: list = []
    for chunk in path.split("."):
        name, _, rest = chunk.partition("[")
        if name:
            parts.append(name)
        for index in filter(None, rest.replace("]", "").split("[")):
            parts.append(int(index))
    return parts


def with_changes(changes: dict) -> dict:
    """BASE with `{"agents[1].runner": "gpt", ...}` applied (DELETE removes the key)."""
    data = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, last = _parse_path(path)
        node = data
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


def write_changed(tmp_path: Path, changes: dict) -> Path:
    (tmp_path / "tasks").mkdir(exist_ok=True)
    return write(tmp_path, yaml.safe_dump(with_changes(changes), sort_keys=False))


def test_base_of_the_invalid_table_is_valid(tmp_path):
    config = cfg.load(write_changed(tmp_path, {}), environ={})
    assert config.warnings == ()
    assert list(config.agents) == ["sh", "coder"]


INVALID = [
    # Worker identity (README "Security"): errors about old tokens name their position, never the value.
    (
        {"settings.queue.worker_token": TOKEN, "settings.queue.previous_worker_tokens": ["short"]},
        "settings.queue.previous_worker_tokens[0]",
        "expected at least 32 characters, got 5",
    ),
    (
        {"settings.queue.worker_token": TOKEN, "settings.queue.previous_worker_tokens": [TOKEN]},
        "settings.queue.previous_worker_tokens[0]",
        "is the current worker_token",
    ),
    ({"settings.queue.previous_worker_tokens": ["o" * 40]}, "settings.queue.previous_worker_tokens", "set worker_token"),
    ({"settings.queue.worker_token": "apw_" + "x" * 40}, "settings.queue.worker_token", "per-worker credentials"),
    (
        {"settings.queue.worker_token": TOKEN, "settings.queue.previous_worker_tokens": ["apw_" + "x" * 40]},
        "settings.queue.previous_worker_tokens[0]",
        "per-worker credentials",
    ),
    ({"settings.queue.previous_worker_tokens": "o" * 40}, "settings.queue.previous_worker_tokens", "expected a list"),
    ({"settings.queue.enrollment": "closed"}, "settings.queue.enrollment", "expected true or false"),
    ({"settings.queue.claim_rate": -1}, "settings.queue.claim_rate", "expected a finite number ≥ 0"),
    ({"settings.queue.claim_rate": "fast"}, "settings.queue.claim_rate", "expected a number"),
    ({"settings.queue.forget_workers_after": "never"}, "settings.queue.forget_workers_after", "never"),
    ({"settings.worker_capacity": 1000}, "settings.worker_capacity", "expected an integer ≤ 256"),
    ({"settings.queue.listener": {"processes": 0}}, "settings.queue.listener.processes", "expected an integer"),
    ({"settings.queue.listener": {"request_timeout": "soon"}}, "settings.queue.listener.request_timeout", "soon"),
    ({"settings.queue.listener": {"threads": 64}}, "settings.queue.listener.threads", "unknown key"),
    ({"settings.queue.listener": 4}, "settings.queue.listener", "expected a mapping"),
    ({"agents[1].runner": "gpt"}, "agents[1].runner", "expected one of codex, claude, shell, got 'gpt'"),
    ({"agents[1].runner": "codex-cli"}, "agents[1].runner", "(did you mean 'codex'?)"),
    ({"agents[1].runner": DELETE}, "agents[1].runner", "required"),
    ({"agents[0].command": DELETE}, "agents[0].command", "required for runner shell"),
    ({"agents[0].command": []}, "agents[0].command", "expected a non-empty argv list"),
    ({"agents[1].command": "x"}, "agents[1].command", "only used by runner shell"),
    ({"agents[0].model": "gpt-5"}, "agents[0].model", "not used by runner shell"),
    ({"agents[1].model": 5}, "agents[1].model", "expected a string, got 5 (a number)"),
    ({"agents[0].id": "bad id"}, "agents[0].id", "matching [A-Za-z0-9][A-Za-z0-9._-]*, got 'bad id'"),
    ({"agents[1].id": "sh"}, "agents[1].id", "duplicate agent id 'sh' (first used at agents[0])"),
    ({"agents[1].requires_labels": "linux"}, "agents[1].requires_labels", "expected a list of labels"),
    ({"agents[1].requires_labels": ["ok", 3]}, "agents[1].requires_labels[1]", "expected a string, got 3"),
    ({"agents[1].workspace_affinity": "yes"}, "agents[1].workspace_affinity", "expected true or false, got 'yes'"),
    ({"agents[1].env": {"1BAD": "x"}}, "agents[1].env.1BAD", "expected an environment variable name"),
    ({"agents[1].env": {"OK": None}}, "agents[1].env.OK", "expected a string"),
    ({"agents[0]": "sh"}, "agents[0]", "expected a mapping (one agent)"),
    ({"agents": {"id": "sh"}}, "agents", "expected a list of agents, got a mapping"),
    ({"project": "has space"}, "project", "expected a project name matching"),
    ({"settings.worker_capacity": 0}, "settings.worker_capacity", "expected an integer ≥ 1"),
    ({"settings.worker_capacity": True}, "settings.worker_capacity", "got true (a boolean)"),
    ({"settings.concurrency": -1}, "settings.concurrency", "expected an integer ≥ 0"),
    ({"settings.queue": []}, "settings.queue", "expected a mapping, got a list"),
    ({"settings.queue.lease_duration": "soon"}, "settings.queue.lease_duration", "expected a duration such as 30s"),
    ({"settings.queue.lease_duration": 0}, "settings.queue.lease_duration", "expected a duration above zero"),
    (
        {"settings.queue.heartbeat_interval": "30s"},
        "settings.queue.heartbeat_interval",
        "expected less than lease_duration (30s), got 30s",
    ),
    (
        {"settings.queue.worker_timeout": "5s"},
        "settings.queue.worker_timeout",
        "expected more than heartbeat_interval (10s), got 5s",
    ),
    (
        {"settings.queue.listen": "0.0.0.0:8080"},
        "settings.queue.worker_token",
        "required when settings.queue.listen is set",
    ),
    (
        {"settings.queue.listen": "8080", "settings.queue.worker_token": TOKEN},
        "settings.queue.listen",
        "expected host:port",
    ),
    (
        {"settings.queue.listen": "h:99999", "settings.queue.worker_token": TOKEN},
        "settings.queue.listen",
        "expected host:port",
    ),
    ({"settings.queue.embedded_worker": "no"}, "settings.queue.embedded_worker", "expected true or false"),
    ({"settings.queue.max_attempts": 0}, "settings.queue.max_attempts", "expected an integer ≥ 1"),
    (
        {"settings.queue.concurrency.runners": {"codex": 3}},
        "settings.queue.concurrency.runners.codex",
        "expected one of codex-cli, claude-code, shell, got 'codex' (did you mean 'codex-cli'?)",
    ),
    (
        {"settings.queue.concurrency.default_agent": -1},
        "settings.queue.concurrency.default_agent",
        "expected an integer ≥ 0",
    ),
    (
        {"settings.queue.concurrency.agents": {"coder": "many"}},
        "settings.queue.concurrency.agents.coder",
        "expected an integer",
    ),
    ({"settings.queue.concurrency.pools": [1]}, "settings.queue.concurrency.pools", "expected a mapping of pool names"),
    ({"workflows[0].agent": "nobody"}, "workflows[0].agent", "unknown agent 'nobody'; known agents: coder, sh"),
    ({"workflows[0].agent": DELETE}, "workflows[0].agent", "required"),
    ({"workflows[0].steps[2].run": DELETE}, "workflows[0].steps[2].prompt", "required: a step needs prompt"),
    ({"workflows[0].steps[2].prompt": "x"}, "workflows[0].steps[2].run", "either prompt"),
    ({"workflows[0].steps[1].id": "one"}, "workflows[0].steps[1].id", "duplicate step id 'one'"),
    ({"workflows[0].steps[1].id": DELETE}, "workflows[0].steps[1].id", "required"),
    ({"workflows[0].steps": []}, "workflows[0].steps", "expected at least one step"),
    ({"workflows[0].steps[0].timeout": "0s"}, "workflows[0].steps[0].timeout", "expected a duration above zero"),
    (
        {"workflows[0].steps[0].continue_on_error": 1},
        "workflows[0].steps[0].continue_on_error",
        "expected true or false",
    ),
    # Effects and hooks (issue 10): publish/spawn are booleans of run steps; hooks are lists of run steps.
    ({"workflows[0].steps[0].publish": "yes"}, "workflows[0].steps[0].publish", "expected true or false, got 'yes'"),
    ({"workflows[0].steps[0].spawn": 1}, "workflows[0].steps[0].spawn", "expected true or false, got 1"),
    (
        {"workflows[0].steps[0].publish": True, "workflows[0].steps[0].spawn": True},
        "workflows[0].steps[0].spawn",
        "either publish (one external effect) or spawn (child tasks), not both",
    ),
    ({"workflows[0].steps[1].publish": True}, "workflows[0].steps[1].publish", "only a run step can be publish"),
    ({"workflows[0].steps[1].spawn": True}, "workflows[0].steps[1].spawn", "only a run step can be spawn"),
    ({"workflows[0].hooks": ["x"]}, "workflows[0].hooks", "expected a mapping, got a list"),
    (
        {"workflows[0].hooks": {"on_succes": [{"run": "x"}]}},
        "workflows[0].hooks.on_succes",
        "unknown key (did you mean 'on_success'?); expected one of on_success, on_failure, on_cancel",
    ),
    ({"workflows[0].hooks": {"on_success": "./notify.sh"}}, "workflows[0].hooks.on_success", "expected a list of steps"),
    ({"workflows[0].hooks": {"on_failure": []}}, "workflows[0].hooks.on_failure", "expected at least one run step"),
    ({"workflows[0].hooks": {"on_cancel": ["x"]}}, "workflows[0].hooks.on_cancel[0]", "expected a mapping (one step)"),
    ({"workflows[0].hooks": {"on_success": [{"id": "n"}]}}, "workflows[0].hooks.on_success[0].run", "required"),
    ({"workflows[0].hooks": {"on_success": [{"run": 3}]}}, "workflows[0].hooks.on_success[0].run", "expected a string"),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "prompt": "y"}]}},
        "workflows[0].hooks.on_success[0].prompt",
        "not for a hook step; a hook step is a command: id, run, timeout, env",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "publish": True}]}},
        "workflows[0].hooks.on_success[0].publish",
        "not for a hook step",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "shell": "bash"}]}},
        "workflows[0].hooks.on_success[0].shell",
        "unknown key; expected one of id, run, timeout, env",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "timeout": "0s"}]}},
        "workflows[0].hooks.on_success[0].timeout",
        "expected a duration above zero",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "env": {"1BAD": "x"}}]}},
        "workflows[0].hooks.on_success[0].env.1BAD",
        "expected an environment variable name",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"run": "x", "id": "bad id"}]}},
        "workflows[0].hooks.on_success[0].id",
        "expected a step id matching",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"id": "n", "run": "x"}, {"id": "n", "run": "y"}]}},
        "workflows[0].hooks.on_success[1].id",
        "duplicate step id 'n' (first used at workflows[0].hooks.on_success[0])",
    ),
    (
        {"workflows[0].hooks": {"on_success": [{"id": "hook-2", "run": "x"}, {"run": "y"}]}},
        "workflows[0].hooks.on_success[1].id",
        "the default id 'hook-2' is taken (at workflows[0].hooks.on_success[0]); give this step an id",
    ),
    ({"workflows[0].retry.max_attempts": 0}, "workflows[0].retry.max_attempts", "expected an integer ≥ 1"),
    (
        {"workflows[0].retry.backoff_max": "1s"},
        "workflows[0].retry.backoff_max",
        "expected at least backoff (5s), got 1s",
    ),
    ({"workflows[0].priority": 1.5}, "workflows[0].priority", "expected an integer"),
    ({"sources[0].workflows": ["nope"]}, "sources[0].workflows[0]", "unknown workflow 'nope'; known workflows: build"),
    ({"sources[0].workflows": ["build", "build"]}, "sources[0].workflows[1]", "listed twice"),
    ({"sources[0].workflows": []}, "sources[0].workflows", "expected at least one workflow id"),
    ({"sources[0].type": "rss"}, "sources[0].type", "expected one of directory, command, got 'rss'"),
    ({"sources[0].path": DELETE}, "sources[0].path", "required for a directory source"),
    ({"sources[0].poll_interval": "-5s"}, "sources[0].poll_interval", "expected a duration"),
    ({"sources[0].redispatch_on_change": "true"}, "sources[0].redispatch_on_change", "expected true or false"),
    ({"sources[1].path": "x"}, "sources[1].path", "only for sources of type directory"),
    ({"sources[1].command": DELETE}, "sources[1].command", "required for a command source"),
    ({"sources[1].command": {"sh": "x"}}, "sources[1].command", "expected a shell string or an argv list"),
]


@pytest.mark.parametrize(("changes", "key_path", "expected"), INVALID, ids=[case[1] for case in INVALID])
def test_invalid_config_names_file_key_path_and_expectation(tmp_path, changes, key_path, expected):
    path = write_changed(tmp_path, changes)
    errors = errors_of(path)
    # Exactly one message: a single mistake does not cascade into follow-on errors.
    assert len(errors) == 1, errors
    prefix = f"{path}: {key_path}: "
    assert errors[0].startswith(prefix), errors
    assert expected in errors[0][len(prefix) :]


@pytest.mark.parametrize(
    ("changes", "key_path"),
    [
        ({"colour": "blue"}, "colour"),
        ({"settings.workers": 2}, "settings.workers"),
        ({"settings.queue.leese_duration": "30s"}, "settings.queue.leese_duration"),
        ({"settings.queue.concurrency.default_projects": 1}, "settings.queue.concurrency.default_projects"),
        ({"agents[1].labels": ["x"]}, "agents[1].labels"),
        ({"workflows[0].retry.jitter": True}, "workflows[0].retry.jitter"),
        ({"workflows[0].steps[2].shell": "bash"}, "workflows[0].steps[2].shell"),
        ({"workflows[0].hooks": {"on_done": [{"run": "x"}]}}, "workflows[0].hooks.on_done"),
        ({"sources[1].interval": "5s"}, "sources[1].interval"),
    ],
)
def test_unknown_keys_are_errors_at_every_depth(tmp_path, changes, key_path):
    path = write_changed(tmp_path, changes)
    [error] = errors_of(path)
    assert error.startswith(f"{path}: {key_path}: unknown key")
    assert "expected one of" in error


def test_unknown_key_suggests_the_close_one(tmp_path):
    path = write_changed(tmp_path, {"settings.queue.leese_duration": "30s"})
    [error] = errors_of(path)
    assert "(did you mean 'lease_duration'?)" in error


def test_every_error_is_reported_at_once(tmp_path):
    path = write_changed(
        tmp_path,
        {"agents[1].runner": "gpt", "settings.queue.lease_duration": "forever", "sources[0].workflows": ["x"]},
    )
    errors = errors_of(path)
    assert [e.split(": ")[1] for e in errors] == [
        "agents[1].runner",
        "sources[0].workflows[0]",
        "settings.queue.lease_duration",
    ]
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.load(path, environ={})
    assert str(caught.value) == "\n".join(errors)


def test_every_effect_and_hook_error_is_reported_at_once(tmp_path):
    hooks = {"on_done": [{"run": "x"}], "on_failure": [{"timeout": "soon"}, {"run": "y", "prompt": "z"}]}
    path = write_changed(tmp_path, {"workflows[0].steps[1].publish": True, "workflows[0].hooks": hooks})
    assert [e.split(": ")[1] for e in errors_of(path)] == [
        "workflows[0].steps[1].publish",
        "workflows[0].hooks.on_done",
        "workflows[0].hooks.on_failure[0].run",
        "workflows[0].hooks.on_failure[0].timeout",
        "workflows[0].hooks.on_failure[1].prompt",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("# only a comment\n", "the file is empty"),
        ("- a\n- b\n", "expected a mapping at the top level, got a list"),
        ("just words\n", "expected a mapping at the top level, got 'just words'"),
        ("agents: [\n", "invalid YAML"),
        ("project: a\nproject: b\n", "line 2, column 1: invalid YAML: duplicate key 'project'"),
    ],
)
def test_unusable_files(tmp_path, text, expected):
    path = write(tmp_path, text)
    [error] = errors_of(path)
    assert error.startswith(f"{path}: ")
    assert expected in error


def test_missing_file(tmp_path):
    [error] = errors_of(tmp_path / "nope.yaml")
    assert error == f"{tmp_path / 'nope.yaml'}: config file not found"


# --------------------------------------------------------------------------- warnings and paths


def test_close_heartbeat_missing_folder_and_dead_limits_are_warnings(tmp_path):
    data = with_changes(
        {
            "settings.queue.heartbeat_interval": "20s",
            "settings.queue.concurrency.agents": {"ghost": 1},
            "sources[0].path": "later",
        }
    )
    config = cfg.load(write(tmp_path, yaml.safe_dump(data)), environ={})
    paths = [w.split(": ")[1] for w in config.warnings]
    assert paths == ["sources[0].path", "settings.queue.heartbeat_interval", "settings.queue.concurrency.agents.ghost"]
    assert config.sources["inbox"].path == tmp_path / "later"


def test_source_path_is_relative_to_the_config_file_not_the_cwd(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "tasks").mkdir(parents=True)
    path = write(project, yaml.safe_dump(with_changes({"sources[0].path": "tasks"})))
    monkeypatch.chdir(tmp_path)
    config = cfg.load("project/apiary.yaml", environ={})
    assert config.path == path
    assert config.sources["inbox"].path == project / "tasks"
    assert config.warnings == ()


def test_source_path_that_is_a_file_is_an_error(tmp_path):
    path = write_changed(tmp_path, {"sources[0].path": "apiary.yaml"})
    [error] = errors_of(path)
    assert error.startswith(f"{path}: sources[0].path: expected a folder")


def test_find_config_path_precedence(tmp_path, monkeypatch):
    here, there, explicit = (tmp_path / n for n in ("here", "there", "explicit"))
    for d in (here, there, explicit):
        d.mkdir()
        write(d, "project: p\n")
    monkeypatch.chdir(here)
    monkeypatch.delenv("APIARY_CONFIG", raising=False)
    assert cfg.find_config_path() == here / "apiary.yaml"
    monkeypatch.setenv("APIARY_CONFIG", str(there / "apiary.yaml"))
    assert cfg.find_config_path() == there / "apiary.yaml"
    assert cfg.find_config_path(str(explicit / "apiary.yaml")) == explicit / "apiary.yaml"
    assert cfg.find_config_path(str(explicit)) == explicit / "apiary.yaml"  # a folder means its apiary.yaml
    monkeypatch.setenv("APIARY_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(cfg.ConfigError, match="missing.yaml: config file not found"):
        cfg.find_config_path()


# --------------------------------------------------------------------------- `apiary check`


def test_checkconfig_ok_prints_counts_and_warnings(tmp_path, capsys):
    path = write_changed(tmp_path, {"settings.queue.heartbeat_interval": "20s"})
    call_command("checkconfig", "--config", str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"OK: {path} (2 sources, 1 workflows, 2 agents)"
    assert out[1].startswith(f"warning: {path}: settings.queue.heartbeat_interval: ")


def test_checkconfig_errors_exit_2_with_every_error(tmp_path, capsys):
    path = write_changed(tmp_path, {"agents[1].runner": "gpt", "workflows[0].priority": "high"})
    with pytest.raises(SystemExit) as exited:
        call_command("checkconfig", "--config", str(path))
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{path}: agents[1].runner: expected one of codex, claude, shell, got 'gpt'",
        f"{path}: workflows[0].priority: expected an integer from -2147483648 to 2147483647, got 'high'",
    ]


def test_checkconfig_process_exit_codes(tmp_path):
    good = write_changed(tmp_path, {})
    bad = write(tmp_path, "agents:\n  - id: a\n    runner: gpt\n", name="bad.yaml")
    env = {**os.environ, "APIARY_DB_PATH": str(tmp_path / "unused.db")}
    env.pop("APIARY_CONFIG", None)

    def run(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "manage.py", "checkconfig", "--config", str(path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = run(good)
    assert (ok.returncode, ok.stdout.strip()) == (0, f"OK: {good} (2 sources, 1 workflows, 2 agents)")
    failed = run(bad)
    assert failed.returncode == 2
    assert failed.stderr.strip() == f"{bad}: agents[0].runner: expected one of codex, claude, shell, got 'gpt'"
    assert not (tmp_path / "unused.db").exists()  # the check never opens the database


def test_apiary_check_routes_to_checkconfig(tmp_path):
    bad = write(tmp_path, "settings: {worker_capacity: 0}\n")
    env = {**os.environ, "APIARY_DB_PATH": str(tmp_path / "unused.db")}
    code = "import sys; from apiary_site.cli import main; main(['apiary', 'check', '--config', sys.argv[1]])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(bad)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"{bad}: settings.worker_capacity: expected an integer ≥ 1, got 0"

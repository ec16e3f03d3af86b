"""YAML and payloads from outside are bounded before they cost anything:
anchors and aliases are refused in apiary.yaml and in front matter (a
"billion laughs" alias bomb is an error naming the file and line, at once),
nesting and sizes are capped (task file, front matter, task payload, job
payload, apiary.yaml), a bad task file is skipped with a warning while the
other items still dispatch, and every YAML parse in the code goes through
workflows.yamlload."""

import json
import logging
import re
import time
from pathlib import Path

import pytest

from workflows import payload, sources
from workflows.config import ConfigError, SourceConfig, load
from workflows.config.loading import CONFIG_CAP
from workflows.controlplane import ControlPlane
from workflows.models import Task
from workflows.sources import SourceError, poll

ROOT = Path(__file__).resolve().parent.parent

# 346 bytes that expand to ~16 MB with plain yaml.safe_load (the probe's front matter).
LAUGHS = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
    "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
    "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
    "h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
    "i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n"
)

CONFIG = """\
project: bounds
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: job, agent: sh, steps: [{id: s, run: "true"}]}]
sources:
  - {id: inbox, type: directory, path: tasks, pattern: "*.md", workflows: [job]}
"""


def directory(path):
    return SourceConfig(id="inbox", type="directory", workflows=("job",), path=path, pattern="*.md")


# --- apiary.yaml ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line",
    [
        (CONFIG + "x-laughs:\n" + "".join("  " + row for row in LAUGHS.splitlines(True)), 7),
        ("defaults: &d {runner: shell, command: cat}\nagents: [{id: sh, <<: *d}]\n", 1),  # an anchor, harmless or not
        ("agents: *nothing\n", 1),  # an alias without its anchor
    ],
)
def test_config_anchors_and_aliases_are_refused_naming_file_and_line(tmp_path, text, line):
    path = tmp_path / "apiary.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert time.monotonic() - started < 2.0  # refused while parsing, not after expanding
    [message] = exc.value.errors
    assert message.startswith(f"{path}: line {line}, column ")
    assert "anchor" in message or "alias" in message


def test_config_nesting_and_size_are_bounded(tmp_path):
    path = tmp_path / "apiary.yaml"
    path.write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested deeper than 32 levels"):
        load(path)
    path.write_text("# " + "x" * CONFIG_CAP + "\n")
    with pytest.raises(ConfigError, match="CONFIG_CAP"):
        load(path)


def test_an_inline_merge_key_still_works(tmp_path):
    path = tmp_path / "apiary.yaml"
    path.write_text(CONFIG.replace("{id: sh, runner: shell, command: cat}", "{id: sh, <<: {runner: shell, command: cat}}"))
    assert load(path).agents["sh"].command == "cat"


# --- task files ----------------------------------------------------------------------------------


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# (file text, what the warning says): each file is skipped, the good one still comes through.
BAD_FILES = [
    ("---\n" + LAUGHS + "---\nbody\n", "line 2, column 4: invalid YAML: anchor &a refused"),
    ("---\ntitle: x\nref: *x\n---\n", "line 3, column 6: invalid YAML: alias *x refused"),
    ("---\nx: " + "[" * 5000 + "]" * 5000 + "\n---\n", "nested deeper than 32 levels"),
    ("---\nx: " + "[" * 20 + "]" * 20 + "\n---\n", "TASK_PAYLOAD_DEPTH"),  # parses, but too deep for a payload
    ("---\n" + "k: " + "v" * (sources.FRONT_MATTER_CAP + 1) + "\n---\n", "FRONT_MATTER_CAP"),
    ("# big\n" + "x" * sources.TASK_FILE_CAP, "TASK_FILE_CAP"),
    ("---\ntitle: a\ntitle: b\n---\n", "duplicate key 'title'"),
]


@pytest.mark.parametrize("text, warning", BAD_FILES)
def test_a_bad_task_file_is_skipped_with_a_clear_warning(tmp_path, caplog, text, warning):
    (tmp_path / "good.md").write_text("# Good\n")
    (tmp_path / "bad.md").write_text(text)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        items = poll(directory(tmp_path))
    assert time.monotonic() - started < 2.0
    assert [item.key for item in items] == ["good.md"]
    assert "bad.md" in _warnings(caplog) and warning in _warnings(caplog)


@pytest.mark.django_db
def test_the_other_items_still_dispatch_beside_an_alias_bomb(tmp_path, caplog):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "bomb.md").write_text("---\n" + LAUGHS + "---\n# Bomb\n")
    (tmp_path / "tasks" / "good.md").write_text("# Good\n")
    control = ControlPlane(config=load(tmp_path / "apiary.yaml"))
    with caplog.at_level(logging.WARNING, logger="apiary"):
        assert control.poll("inbox") == 1
    assert list(Task.objects.values_list("item_key", flat=True)) == ["good.md"]
    assert "bomb.md" in _warnings(caplog) and "anchor &a refused" in _warnings(caplog)
    assert control.failed_sources() == set()


# --- command items and payloads ------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"id": 1, "n": NaN}', "NaN is not valid JSON"),
        ('{"id": 1, "n": -Infinity}', "-Infinity is not valid JSON"),
        ('{"id": 1, "deep": ' + "[" * 3000 + "]" * 3000 + "}", "nested deeper"),
        ('{"id": 1, "deep": ' + "[" * 20 + "]" * 20 + "}", "TASK_PAYLOAD_DEPTH"),
        (json.dumps({"id": 1, "big": "x" * payload.TASK_PAYLOAD_CAP}), "TASK_PAYLOAD_CAP"),
    ],
)
def test_command_items_over_the_bounds_are_a_source_error_not_a_crash(tmp_path, line, expected):
    (tmp_path / "out.jsonl").write_text(line + "\n")
    feed = SourceConfig(id="feed", type="command", workflows=("job",), command=["cat", str(tmp_path / "out.jsonl")])
    with pytest.raises(SourceError, match=re.escape(expected)):
        poll(feed, cwd=tmp_path)


class _Task:
    pk, source, item_key, generation, title, payload = 1, "manual", "k", 1, "t", {}

    def __init__(self, body):
        self.body = body


def test_the_job_payload_is_capped():
    assert payload.payload_of(workflow="w", instance_id=1, task=_Task("x" * 1000))["task"]["body"] == "x" * 1000
    with pytest.raises(payload.PayloadError, match="JOB_PAYLOAD_CAP"):
        payload.payload_of(workflow="w", instance_id=1, task=_Task("x" * payload.JOB_PAYLOAD_CAP))


# --- one YAML loader -----------------------------------------------------------------------------


def test_every_yaml_parse_goes_through_workflows_yamlload():
    calls = re.compile(r"\byaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all|compose|parse)\b")
    offenders = []
    for package in ("jobqueue", "workers", "workflows", "apiary_site"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "workflows" / "yamlload.py":
                continue
            offenders += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1) if calls.search(line)]
    assert offenders == []

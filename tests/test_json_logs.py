"""`APIARY_LOG_FORMAT=json` (or `settings.log_format: json`) makes every
Apiary log line one JSON object — time, level, logger, message and the
record's extra fields — and keeps EscapingFormatter's guarantee: no text in a
record (a task title, a file name, an error) can start a line of its own."""

import json
import logging
import subprocess
import sys

import pytest

from apiary_site import logformat
from jobqueue.text import JsonFormatter
from tests.daemon import REPO, clean_env
from tests.test_log_escaping import FORGED

HOSTILE = "x\n" + FORGED + "\r\x1b[2J\x85\u2028\u2029\x7f\ud800 ünïcödé ✓"


def _record(message, args=(), exc_info=None, **extra) -> logging.LogRecord:
    record = logging.LogRecord("apiary.sources", logging.WARNING, __file__, 1, message, args, exc_info)
    record.__dict__.update(extra)
    return record


def test_a_record_is_one_json_object_with_its_fields():
    line = JsonFormatter().format(_record("skipping %s", ("it",), job_id=7, worker="w1"))
    entry = json.loads(line)
    assert entry["level"] == "WARNING"
    assert entry["logger"] == "apiary.sources"
    assert entry["message"] == "skipping it"
    assert entry["time"].endswith("Z") and "T" in entry["time"]
    assert entry["job_id"] == 7 and entry["worker"] == "w1"
    assert set(entry) == {"time", "level", "logger", "message", "job_id", "worker"}  # no LogRecord internals


def test_hostile_text_stays_on_one_line_and_reads_back_unchanged():
    line = JsonFormatter().format(_record("skipping %s", (HOSTILE,), title=HOSTILE))
    assert len(line.splitlines()) == 1  # str.splitlines breaks at \x85, \u2028, \u2029 too
    assert not any(c in line for c in "\x1b\x7f\x85\u2028\u2029")
    line.encode("utf-8")  # a lone surrogate is escaped: any UTF-8 stream can write the line
    entry = json.loads(line)
    assert entry["message"] == "skipping " + HOSTILE and entry["title"] == HOSTILE
    assert "ünïcödé ✓" in line  # readable text stays readable


def test_a_traceback_is_a_field_not_lines():
    try:
        raise ValueError("bad name\n" + FORGED)
    except ValueError:
        line = JsonFormatter().format(_record("poll raised", exc_info=sys.exc_info()))
    assert len(line.splitlines()) == 1
    entry = json.loads(line)
    assert entry["exception"].startswith("Traceback") and FORGED in entry["exception"]


def test_unserialisable_extras_are_written_as_text():
    entry = json.loads(JsonFormatter().format(_record("m", path=REPO)))
    assert entry["path"] == str(REPO)


@pytest.mark.parametrize(
    "env, config, expected",
    [("", "plain", "plain"), ("", "json", "json"), ("json", "plain", "json"), ("plain", "json", "plain"), ("xml", "json", "json")],
)
def test_the_environment_wins_over_the_config(monkeypatch, env, config, expected):
    monkeypatch.setenv("APIARY_LOG_FORMAT", env)
    assert logformat.chosen(config) == expected


def test_apply_switches_the_apiary_handlers():
    handlers = logging.getLogger("apiary").handlers
    before = [h.formatter for h in handlers]
    try:
        logformat.apply("json")
        assert handlers and all(isinstance(h.formatter, JsonFormatter) for h in handlers)
    finally:
        for handler, formatter in zip(handlers, before, strict=True):
            handler.setFormatter(formatter)


CONFIG = """\
project: logs
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: inbox, type: directory, path: tasks, pattern: "*", poll_interval: 1s, workflows: [w]}]
"""


@pytest.mark.processes
@pytest.mark.parametrize("how", ["env", "config"])
def test_a_daemon_logs_one_json_object_a_line_either_way(tmp_path, how):
    extra = "settings: {log_format: json}\n" if how == "config" else ""
    (tmp_path / "apiary.yaml").write_text(CONFIG + extra)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"task\n{FORGED}\x1b[2K.md").write_text("# A task\n")  # dispatched: its key is logged
    result = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "runapiary", "--until-idle", "--config", str(tmp_path / "apiary.yaml")],
        cwd=tmp_path, env=clean_env(**({"APIARY_LOG_FORMAT": "json"} if how == "env" else {})),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    entries = [json.loads(line) for line in lines]  # every line is one object
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    assert any(e["logger"] == "apiary.controlplane" and e["message"].startswith("control plane up") for e in entries)
    assert any(f"task\n{FORGED}\x1b[2K.md" in e["message"] for e in entries)  # the dispatch line, intact once parsed
    assert not any(line.startswith(FORGED) for line in lines) and "\x1b" not in result.stderr

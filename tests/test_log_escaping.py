"""A log line is one line: control characters in what a record says (a file
name, a task title, an error) are escaped by the formatter settings.LOGGING
installs (jobqueue.text.EscapingFormatter), so outside text cannot forge a
line in the daemon's log."""

import logging
import re
import sys

import pytest
from django.conf import settings

from jobqueue.text import EscapingFormatter, escape_controls
from tests.daemon import run

FORGED = "2026-01-01 00:00:00,000 ERROR apiary.worker forged"


@pytest.mark.parametrize(
    "text, escaped",
    [
        ("a\nb", "a\\nb"),
        ("a\r\nb", "a\\r\\nb"),
        ("\x1b[2J\x1b[31mred", "\\x1b[2J\\x1b[31mred"),
        ("bell\x07 nul\x00 del\x7f", "bell\\x07 nul\\x00 del\\x7f"),
        ("nel\x85 csi\x9b", "nel\\x85 csi\\x9b"),
        ("line\u2028sep\u2029", "line\\u2028sep\\u2029"),
        ("tab\tstays, ünïcödé ✓ too", "tab\tstays, ünïcödé ✓ too"),
    ],
)
def test_control_characters_are_escaped(text, escaped):
    assert escape_controls(text) == escaped


def _formatted(message, args=(), exc_info=None) -> str:
    formatter = EscapingFormatter("%(levelname)s %(name)s %(message)s")
    record = logging.LogRecord("apiary.sources", logging.WARNING, __file__, 1, message, args, exc_info)
    return formatter.format(record)


def test_a_record_stays_on_one_line_and_only_its_message_is_escaped():
    line = _formatted("skipping %s: %s", ("x\n" + FORGED, "why\x1b[0m"))
    assert line == "WARNING apiary.sources skipping x\\n" + FORGED + ": why\\x1b[0m"


def test_a_traceback_keeps_its_lines_but_none_can_pass_for_a_log_line():
    try:
        raise ValueError("bad name\n" + FORGED)
    except ValueError:
        text = _formatted("poll raised", exc_info=sys.exc_info())
    first, *rest = text.splitlines()
    assert first == "WARNING apiary.sources poll raised"
    assert rest and all(line.startswith("    ") for line in rest)
    assert "Traceback" in text and not any(line.startswith(FORGED) for line in text.splitlines())


def test_settings_install_the_formatter_for_the_apiary_loggers():
    assert settings.LOGGING["formatters"]["plain"]["()"] == "jobqueue.text.EscapingFormatter"


CONFIG = """\
project: logs
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: inbox, type: directory, path: tasks, pattern: "*", poll_interval: 1s, workflows: [w]}]
"""


def test_a_file_name_with_a_newline_cannot_forge_a_line_in_the_daemon_log(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"task\n{FORGED}\x1b[2K.md").write_text("# A task\n")  # dispatched: its key is logged
    (tasks / f"bin\n{FORGED}.md").write_bytes(b"\0binary")  # skipped: its path is logged
    result = run("runapiary", "--until-idle", config=tmp_path / "apiary.yaml", timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+ ", line) for line in lines), lines
    assert not any(line.startswith(FORGED) for line in lines)
    assert "\x1b" not in result.stderr
    assert f"task\\n{FORGED}\\x1b[2K.md" in result.stderr  # the dispatch line names the key, escaped
    assert f"bin\\n{FORGED}.md" in result.stderr  # so does the skipped file's warning

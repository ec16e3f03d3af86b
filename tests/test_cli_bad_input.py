"""Bad input to an operator command ends with a message naming what is wrong
and a non-zero exit, never a traceback: a payload JSON cannot store (NaN,
±Infinity) or that nests too deep, ids that cannot be row ids, a folder where
`apiary run` never ran (no queue database yet).

Real `apiary` processes (manage.py, as tests/daemon.py runs them), in a
folder with a config and no database."""

import json

import pytest

from tests.daemon import run

CONFIG = """\
project: bad-input
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: feed, type: command, command: "true", workflows: [w]}]
"""

DEEP = json.dumps({"a": 1}).replace("1", "[" * 3000 + "]" * 3000)

# (arguments, exit status, text the error must hold)
CASES = [
    (["task", "add", "--title", "t", "--workflow", "w", "--payload", '{"a": NaN}'], 1, "--payload: NaN is not valid JSON"),
    (["task", "add", "--title", "t", "--workflow", "w", "--payload", '{"a": -Infinity}'], 1, "--payload: -Infinity"),
    (["task", "add", "--title", "t", "--workflow", "w", "--payload", '{"a": 1e999}'], 1, "--payload: number 1e999"),
    (["task", "add", "--title", "t", "--workflow", "w", "--payload", DEEP], 1, "--payload: JSON nested deeper than 16"),
    (["task", "add", "--title", "t", "--workflow", "w", "--payload", '{"a":' * 20 + "1" + "}" * 20], 1, "--payload: nested 20 levels deep"),
    (["cancel", "5"], 1, "no queue database yet"),
    (["affinity", "release", "5"], 1, "no queue database yet"),
    (["drainworker", "ghost"], 1, "no queue database yet"),
    (["cancel", "99999999999999999999999"], 2, "expected an id"),
    (["affinity", "release", "0"], 2, "expected an id"),
    (["cancel", "abc"], 2, "expected an id"),
]


@pytest.mark.parametrize("args, status, expected", CASES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None)
def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, args, status, expected):
    config = tmp_path / "apiary.yaml"
    config.write_text(CONFIG)
    result = run(*args, config=config)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == status, result.stderr
    assert expected in result.stderr
    assert not (tmp_path / ".apiary" / "apiary.db").exists()  # refused before anything was created

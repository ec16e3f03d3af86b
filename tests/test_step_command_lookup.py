"""A step's command is looked up on its own PATH once, as a shell hashes a command
(runners._start): the child then makes one execve instead of one per PATH entry. It runs
what the child's own lookup would run, and looks again when what it found is gone."""

import os
import threading

import pytest

from workflows import runners
from workflows.runners import run_step


@pytest.fixture(autouse=True)
def no_hashed_commands(monkeypatch):
    monkeypatch.setattr(runners, "_hashed", {})


def tool(folder, says):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "apiary-test-tool"
    path.write_text(f"#!/bin/sh\necho {says}\n")
    path.chmod(0o755)
    return path


def run(tmp_path, path_value, name="apiary-test-tool"):
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    result = run_step(
        [name], cwd=workspace, env={"PATH": path_value}, stdin=None, log_path=tmp_path / "logs" / "step.log",
        timeout=30, cancel=threading.Event(),
    )  # fmt: skip
    assert result.status == "succeeded", result.output_tail
    return result.output.strip()


def test_the_first_command_on_the_steps_path_runs_and_is_remembered(tmp_path):
    first, later = tool(tmp_path / "first", "first"), tool(tmp_path / "later", "later")
    path_value = os.pathsep.join([str(first.parent), str(later.parent), "/usr/bin", "/bin"])
    assert run(tmp_path, path_value) == "first"
    assert runners._hashed == {("apiary-test-tool", path_value): str(first)}
    assert run(tmp_path, path_value) == "first"


def test_a_command_gone_since_its_lookup_is_looked_up_again(tmp_path):
    first, later = tool(tmp_path / "first", "first"), tool(tmp_path / "later", "later")
    path_value = os.pathsep.join([str(first.parent), str(later.parent), "/usr/bin", "/bin"])
    assert run(tmp_path, path_value) == "first"
    first.unlink()
    assert run(tmp_path, path_value) == "later"
    assert runners._hashed == {("apiary-test-tool", path_value): str(later)}


def test_a_relative_path_entry_is_the_childs_to_resolve_in_the_workspace(tmp_path):
    """The child looks after its chdir: `bin` on PATH is the workspace's bin, which this
    process, in another folder, cannot see; so nothing is looked up for it here."""
    tool(tmp_path / "ws" / "bin", "workspace")
    absolute = tool(tmp_path / "absolute", "absolute")
    path_value = os.pathsep.join(["bin", str(absolute.parent), "/usr/bin", "/bin"])
    assert run(tmp_path, path_value) == "workspace"
    assert runners._hashed == {}


def test_a_command_named_by_its_path_is_run_as_named(tmp_path):
    named = tool(tmp_path / "named", "named")
    assert run(tmp_path, "/usr/bin:/bin", name=str(named)) == "named"
    assert runners._hashed == {}

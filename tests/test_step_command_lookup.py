"""A step's command is looked up on its own PATH once, as a shell hashes a command
(runners._start): the child then makes one execve instead of one per PATH entry. It runs
what the child's own search would run; where what was found cannot run any more, the
child's own search decides, as without the hash; an entry is looked up again after
HASH_SECONDS."""

import os
import threading

import pytest

from workflows import runners
from workflows.runners import run_step

pytestmark = pytest.mark.processes


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


def hashed() -> dict:
    return {key: found for key, (found, _at) in runners._hashed.items()}


def folders(*paths) -> str:
    return os.pathsep.join([*(str(p) for p in paths), "/usr/bin", "/bin"])


def test_the_first_command_on_the_steps_path_runs_and_is_remembered(tmp_path):
    first, later = tool(tmp_path / "first", "first"), tool(tmp_path / "later", "later")
    path_value = folders(first.parent, later.parent)
    assert run(tmp_path, path_value) == "first"
    assert hashed() == {("apiary-test-tool", path_value): str(first)}
    assert run(tmp_path, path_value) == "first"


@pytest.mark.parametrize("change", ["removed", "no longer executable", "its interpreter gone"])
def test_a_command_that_cannot_run_since_its_lookup_is_left_to_the_childs_search(tmp_path, change):
    first, later = tool(tmp_path / "first", "first"), tool(tmp_path / "later", "later")
    path_value = folders(first.parent, later.parent)
    assert run(tmp_path, path_value) == "first"
    if change == "removed":
        first.unlink()
    elif change == "no longer executable":
        first.chmod(0o644)
    else:
        first.write_text("#!/nonexistent/interpreter\necho first\n")
    assert run(tmp_path, path_value) == "later"  # the child skips what it cannot run, as before
    assert hashed() == {}
    assert run(tmp_path, path_value) == "later"
    # A lookup skips what is gone or not executable; a script whose interpreter is gone looks
    # runnable, so it is found, fails and is dropped again at each step, the child deciding.
    found_again = {} if change == "its interpreter gone" else {("apiary-test-tool", path_value): str(later)}
    assert hashed() == found_again


def test_a_command_installed_in_an_earlier_folder_is_found_once_the_entry_is_old(tmp_path, monkeypatch):
    early, first = tmp_path / "early", tool(tmp_path / "first", "first")
    early.mkdir()
    path_value = folders(early, first.parent)
    assert run(tmp_path, path_value) == "first"
    tool(early, "early")
    assert run(tmp_path, path_value) == "first"  # hashed, as a shell's would be
    monkeypatch.setattr(runners, "HASH_SECONDS", 0.0)
    assert run(tmp_path, path_value) == "early"


@pytest.mark.parametrize("entry", ["bin", ""], ids=["relative", "empty"])
def test_a_path_with_a_relative_entry_is_the_childs_to_search_in_the_workspace(tmp_path, entry):
    """The child looks after its chdir: `bin` (or an empty entry, the current folder) names a
    folder of the workspace, which this process, elsewhere, cannot see; so nothing is hashed."""
    tool(tmp_path / "ws" / entry, "workspace")
    absolute = tool(tmp_path / "absolute", "absolute")
    path_value = os.pathsep.join([entry, str(absolute.parent), "/usr/bin", "/bin"])
    assert run(tmp_path, path_value) == "workspace"
    assert hashed() == {}


def test_a_command_named_by_its_path_is_run_as_named(tmp_path):
    named = tool(tmp_path / "named", "named")
    assert run(tmp_path, "/usr/bin:/bin", name=str(named)) == "named"
    assert hashed() == {}

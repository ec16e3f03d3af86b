import contextlib
import json
import logging
import os
import signal
import threading
import tracemalloc
from pathlib import Path

import pytest

from workflows.config import SourceConfig
from workflows.sources import SourceError, poll


def directory(path, pattern="*"):
    return SourceConfig(id="inbox", type="directory", workflows=("triage",), path=path, pattern=pattern)


def command(cmd, poll_interval=1.0):
    return SourceConfig(id="feed", type="command", workflows=("triage",), command=cmd, poll_interval=poll_interval)


# --- directory -----------------------------------------------------------------------------------


def test_directory_items_titles_and_front_matter(tmp_path):
    (tmp_path / "b.md").write_text("intro line\n\n# The heading ##\nbody text\n")
    (tmp_path / "a.md").write_text(
        "---\ntitle: From front matter\npriority: 2\ndue: 2025-01-31\ntags: [x, y]\npath: not-this\n---\n# Ignored heading\nbody\n"
    )
    (tmp_path / "c.txt").write_text("\n\n  first non-empty line  \nsecond\n")
    (tmp_path / "d.md").write_text("")
    items = poll(directory(tmp_path))
    assert [i.key for i in items] == ["a.md", "b.md", "c.txt", "d.md"]
    a, b, c, d = items
    assert a.title == "From front matter"
    assert a.body == "# Ignored heading\nbody\n"
    assert a.payload == {
        "title": "From front matter",
        "priority": 2,
        "due": "2025-01-31",  # YAML date made JSON-safe
        "tags": ["x", "y"],
        "path": str(tmp_path / "a.md"),  # ours wins over the front matter's
        "body": "# Ignored heading\nbody\n",
    }
    json.dumps(a.payload)
    assert b.title == "The heading"
    assert b.body == "intro line\n\n# The heading ##\nbody text\n"
    assert c.title == "first non-empty line"
    assert d.title == "d.md"
    assert all(i.updated_at for i in items)


def test_directory_pattern_recursive_and_hidden_files(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "top.md").write_text("top")
    (tmp_path / "notes.txt").write_text("n")
    (tmp_path / "sub" / "one.md").write_text("one")
    (tmp_path / "sub" / "deeper" / "two.md").write_text("two")
    (tmp_path / ".hidden.md").write_text("h")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.md").write_text("g")
    assert [i.key for i in poll(directory(tmp_path, "**/*.md"))] == ["sub/deeper/two.md", "sub/one.md", "top.md"]
    assert [i.key for i in poll(directory(tmp_path, "*.md"))] == ["top.md"]
    assert [i.key for i in poll(directory(tmp_path))] == ["notes.txt", "top.md"]  # folders are not items


def test_directory_changed_content_changes_hash_only_for_that_item(tmp_path):
    (tmp_path / "a.md").write_text("# A\n")
    (tmp_path / "b.md").write_text("# B\n")
    first = {i.key: i.content_hash for i in poll(directory(tmp_path))}
    assert first == {i.key: i.content_hash for i in poll(directory(tmp_path))}  # stable
    (tmp_path / "a.md").write_text("# A\nmore\n")
    second = {i.key: i.content_hash for i in poll(directory(tmp_path))}
    assert second["a.md"] != first["a.md"]
    assert second["b.md"] == first["b.md"]


def test_directory_skips_binary_undecodable_and_bad_front_matter(tmp_path, caplog):
    (tmp_path / "good.md").write_text("# ok")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "broken.md").write_text("---\ntitle: [unclosed\n---\nbody\n")
    (tmp_path / "list.md").write_text("---\n- a\n- b\n---\nbody\n")
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        items = poll(directory(tmp_path))
    assert [i.key for i in items] == ["good.md"]
    for name in ("image.png", "latin1.txt", "broken.md", "list.md"):
        assert name in caplog.text


def test_directory_skips_unreadable_file(tmp_path, monkeypatch, caplog):
    # We run as root, where chmod 0 does not stop a read; fail the read itself instead.
    (tmp_path / "secret.md").write_text("x")
    (tmp_path / "open.md").write_text("y")
    real = os.open

    def fake_open(path, flags, *args, **kwargs):  # the source opens each file with os.open (O_NOFOLLOW)
        if os.fspath(path) == "secret.md":
            raise PermissionError(13, "Permission denied", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        assert [i.key for i in poll(directory(tmp_path))] == ["open.md"]
    assert "secret.md" in caplog.text and "Permission denied" in caplog.text


def test_missing_directory_is_a_source_error(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        poll(directory(tmp_path / "nope"))


def test_relative_directory_is_resolved_against_cwd(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "x.md").write_text("# X")
    [item] = poll(directory("tasks"), cwd=tmp_path)
    assert item.payload["path"] == str(tmp_path / "tasks" / "x.md")


# --- command -------------------------------------------------------------------------------------


def test_command_json_array(tmp_path):
    data = [
        {"id": 1, "title": "One", "body": "b1", "updated_at": "2025-01-01T00:00:00Z", "priority": "high"},
        {"id": "two", "body": "# Heading of two\nrest", "labels": ["x"]},
    ]
    (tmp_path / "out.json").write_text(json.dumps(data))
    items = poll(command(("cat", "out.json")), cwd=tmp_path)
    assert [i.key for i in items] == ["1", "two"]
    one, two = items
    assert (one.title, one.body, one.updated_at, one.payload) == (
        "One",
        "b1",
        "2025-01-01T00:00:00Z",
        {"priority": "high"},
    )
    assert (two.title, two.updated_at, two.payload) == ("Heading of two", None, {"labels": ["x"]})


def test_command_json_lines_via_sh(tmp_path):
    script = """printf '%s\\n' '{"id": "a", "title": "A"}' '' '{"id": "b"}'"""
    items = poll(command(script), cwd=tmp_path)
    assert [(i.key, i.title) for i in items] == [("a", "A"), ("b", "b")]


def test_command_empty_output_is_no_items(tmp_path):
    assert poll(command("true")) == []


def test_command_hash_changes_with_content_or_updated_at_not_key_order(tmp_path):
    def hashes(objs):
        (tmp_path / "out.json").write_text(json.dumps(objs))
        return [i.content_hash for i in poll(command(("cat", "out.json")), cwd=tmp_path)]

    base = hashes([{"id": "a", "title": "T", "updated_at": "1"}])
    assert hashes([{"updated_at": "1", "title": "T", "id": "a"}]) == base
    assert hashes([{"id": "a", "title": "T", "updated_at": "2"}]) != base
    assert hashes([{"id": "a", "title": "T2", "updated_at": "1"}]) != base


def test_command_failure_reports_exit_code_and_stderr_tail():
    noisy = "i=0; while [ $i -lt 500 ]; do echo noise-$i >&2; i=$((i+1)); done; echo the-real-error >&2; exit 7"
    with pytest.raises(SourceError) as exc:
        poll(command(noisy))
    message = str(exc.value)
    assert "feed" in message and "exited with 7" in message
    assert "the-real-error" in message
    assert "noise-0\n" not in message  # only the tail
    assert len(message) < 2600


def test_command_timeout_kills_it_and_its_children(monkeypatch, tmp_path):
    monkeypatch.setattr("workflows.sources.COMMAND_MIN_TIMEOUT", 0.3)
    with pytest.raises(SourceError, match="timed out"):
        poll(command(f"echo started >&2; sleep 60 & echo $! > {tmp_path}/child; sleep 60", poll_interval=0.1))
    child = int((tmp_path / "child").read_text())
    assert not Path(f"/proc/{child}").exists() or _is_zombie(child)


@pytest.mark.parametrize(
    "output, expected",
    [
        ('[{"id": 1}', "not a JSON array"),
        ('{"id": 1}\nnot json', "line 2 is not JSON"),
        ('[{"id": 1}, 5]', "item 2 is int"),
        ('[{"title": "no id"}]', "missing 'id'"),
        ('[{"id": null}]', "'id' must be"),
        ('[{"id": true}]', "'id' must be"),
        ('[{"id": 1}, {"id": "1"}]', "appears twice"),
    ],
)
def test_command_malformed_output(tmp_path, output, expected):
    (tmp_path / "out").write_text(output)
    with pytest.raises(SourceError, match=expected) as exc:
        poll(command("cat out; echo warn-from-stderr >&2"), cwd=tmp_path)
    if "twice" not in expected:
        assert "exit 0" in str(exc.value) and "warn-from-stderr" in str(exc.value)


def test_command_that_cannot_start():
    with pytest.raises(SourceError, match="cannot start"):
        poll(command(("no-such-binary-xyz",)))


def _is_zombie(pid):
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return raw[raw.rindex(")") + 2] in "ZX"


# --- command: bounds on time and memory --------------------------------------------------------------


@pytest.fixture
def leftovers(tmp_path):
    """Pids a test's command writes to `pids`, ended after the test whatever happened."""
    yield tmp_path / "pids"
    if (tmp_path / "pids").exists():
        for pid in (tmp_path / "pids").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _poll_in_thread(source, cwd):
    """Run poll in a daemon thread so a poll that never returns cannot hang the test run."""
    box = {}

    def run():
        try:
            box["items"] = poll(source, cwd=cwd)
        except SourceError as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_command_timeout_holds_when_a_child_left_the_group_and_keeps_the_pipes(monkeypatch, tmp_path, leftovers):
    # Like a credential helper or ssh ControlPersist: a child in its own session keeps stdout and
    # stderr open long after the command is killed; the poll must not wait for it.
    monkeypatch.setattr("workflows.sources.COMMAND_MIN_TIMEOUT", 0.5)
    thread, box = _poll_in_thread(
        command(f"setsid sleep 300 & echo $! >> {leftovers}; echo '[]'; sleep 300", poll_interval=0.1), tmp_path
    )
    thread.join(30)  # a deadline for the condition, far below the orphan's 300 s
    assert not thread.is_alive(), "poll is still waiting for the pipes of a process outside the group"
    assert "timed out" in str(box["error"])


def test_command_output_is_complete_when_the_command_exits_though_a_background_child_holds_the_pipe(
    monkeypatch, tmp_path, leftovers
):
    monkeypatch.setattr("workflows.sources.COMMAND_MIN_TIMEOUT", 60.0)
    thread, box = _poll_in_thread(
        command(f"""sleep 300 & echo $! >> {leftovers}; echo '[{{"id": 1}}]'""", poll_interval=0.1), tmp_path
    )
    thread.join(30)
    assert not thread.is_alive(), "poll waits for a background child after the command itself exited"
    assert [item.key for item in box["items"]] == ["1"]
    child = int(leftovers.read_text().split()[0])
    assert not Path(f"/proc/{child}").exists() or _is_zombie(child)  # its group was ended with it


def test_command_output_over_the_cap_is_an_error_naming_it_and_is_not_buffered(monkeypatch, tmp_path):
    monkeypatch.setattr("workflows.sources.STDOUT_CAP", 1024 * 1024)
    noisy = """i=0; while [ $i -lt 300000 ]; do echo '{"id": "x", "title": "padding padding padding padding"}'; i=$((i+1)); done"""
    tracemalloc.start()
    try:
        with pytest.raises(SourceError) as exc:
            poll(command(noisy), cwd=tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "1048576 bytes" in str(exc.value) and "STDOUT_CAP" in str(exc.value)
    assert peak < 6 * 1024 * 1024, f"{peak} bytes allocated while reading ~20 MB of output with a 1 MiB cap"


def test_command_that_closes_its_output_and_keeps_running_still_times_out(monkeypatch, tmp_path):
    monkeypatch.setattr("workflows.sources.COMMAND_MIN_TIMEOUT", 0.5)
    with pytest.raises(SourceError, match="timed out"):
        poll(command(f"echo $$ > {tmp_path}/pid; exec >&- 2>&-; sleep 300", poll_interval=0.1), cwd=tmp_path)
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)

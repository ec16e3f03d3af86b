import json
import logging
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
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "secret.md":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
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

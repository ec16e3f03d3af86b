"""A directory source reads regular files inside its folder and nothing else:
a symlink (to a file or a folder, inside or outside the folder, there from the
start or swapped in after the glob) is skipped and logged once, and the other
items still come through."""

import logging
import os
from collections import OrderedDict
from pathlib import Path

import pytest

from workflows import sources
from workflows.config import SourceConfig
from workflows.sources import poll

SECRET = "the-django-secret-key-0123456789"


def directory(path, pattern="*.md"):
    return SourceConfig(id="inbox", type="directory", workflows=("triage",), path=path, pattern=pattern)


@pytest.fixture(autouse=True)
def _fresh_skip_memory(monkeypatch):
    monkeypatch.setattr(sources, "_skipped", OrderedDict())


@pytest.fixture
def project(tmp_path):
    """tmp/.apiary/secret_key beside tmp/tasks/, as `apiary run` lays them out."""
    (tmp_path / ".apiary").mkdir()
    (tmp_path / ".apiary" / "secret_key").write_text(SECRET)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "o.md").write_text(f"# {SECRET}\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "good.md").write_text("# A real task\n")
    return tmp_path


def _leaks(items) -> bool:
    return any(SECRET in repr(item) or "root:x:0:0" in repr(item) for item in items)


# (name of the link below tasks/, its target, the pattern): each must be skipped.
LINKS = [
    ("s.md", "../.apiary/secret_key", "*.md"),  # the finding: the SECRET_KEY as a task title
    ("p.md", "/etc/passwd", "*.md"),  # an absolute target
    ("inside.md", "good.md", "*.md"),  # even a link to a file inside the folder
    ("sub", "../outside", "*/*.md"),  # a folder link matched by a pattern through it
    ("sub", "../outside", "sub/o.md"),
    ("sub", "/etc", "sub/passwd"),
]


@pytest.mark.parametrize("name, target, pattern", LINKS)
def test_a_symlink_is_skipped_and_the_other_items_still_come_through(project, caplog, name, target, pattern):
    tasks = project / "tasks"
    (tasks / name).symlink_to(target)
    (tasks / "sub2").mkdir()
    (tasks / "sub2" / "real.md").write_text("# Real, in a real folder\n")
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        items = poll(directory(tasks, pattern))
    assert not _leaks(items)
    assert name not in {item.key.split("/")[0] for item in items}
    if pattern == "*.md":
        assert [item.key for item in items] == ["good.md"]
    else:
        assert [item.key for item in poll(directory(tasks, "*/*.md"))] == ["sub2/real.md"]


def test_recursive_pattern_does_not_follow_a_folder_link(project):
    tasks = project / "tasks"
    (tasks / "sub").symlink_to("../outside")
    assert [item.key for item in poll(directory(tasks, "**/*.md"))] == ["good.md"]


def test_a_file_swapped_for_a_symlink_after_the_glob_is_refused(project, monkeypatch):
    """The check and the open are one step (O_NOFOLLOW): a file replaced by a
    symlink between the directory listing and the read is not followed."""
    tasks = project / "tasks"
    (tasks / "swap.md").write_text("# harmless at listing time\n")
    real_glob = Path.glob

    def glob_then_swap(self, pattern):
        found = list(real_glob(self, pattern))
        (tasks / "swap.md").unlink()
        (tasks / "swap.md").symlink_to("../.apiary/secret_key")
        return found

    monkeypatch.setattr(Path, "glob", glob_then_swap)
    items = poll(directory(tasks))
    assert [item.key for item in items] == ["good.md"]
    assert not _leaks(items)


def test_a_folder_swapped_for_a_symlink_after_the_glob_is_refused(project, monkeypatch):
    tasks = project / "tasks"
    (tasks / "sub").mkdir()
    (tasks / "sub" / "o.md").write_text("# harmless at listing time\n")
    real_glob = Path.glob

    def glob_then_swap(self, pattern):
        found = list(real_glob(self, pattern))
        (tasks / "sub" / "o.md").unlink()
        (tasks / "sub").rmdir()
        (tasks / "sub").symlink_to("../outside")
        return found

    monkeypatch.setattr(Path, "glob", glob_then_swap)
    items = poll(directory(tasks, "*/*.md"))
    assert items == []


def test_a_fifo_is_skipped_without_waiting_for_a_writer(project):
    tasks = project / "tasks"
    os.mkfifo(tasks / "pipe.md")
    assert [item.key for item in poll(directory(tasks))] == ["good.md"]


def test_a_skipped_link_is_logged_once_with_its_name_escaped(project, caplog):
    tasks = project / "tasks"
    (tasks / "evil\n2026-01-01 00:00:00,000 ERROR apiary forged.md").symlink_to("/etc/passwd")
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        for _ in range(3):
            assert [item.key for item in poll(directory(tasks))] == ["good.md"]
    skipped = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert len(skipped) == 1
    assert "\n" not in skipped[0] and "evil\\n2026" in skipped[0]


def test_the_memory_of_skipped_links_stays_bounded_and_forgets_the_least_recently_seen(project, caplog, monkeypatch):
    # One symlink name after another (a tool that makes links with fresh names): without a
    # bound the memory of what was logged grows by one entry per name, for as long as the daemon runs.
    monkeypatch.setattr(sources, "SKIPPED_CAP", 3)
    tasks = project / "tasks"
    (tasks / "stays.md").symlink_to("/etc/passwd")
    with caplog.at_level(logging.WARNING, logger="apiary.sources"):
        for n in range(10):
            link = tasks / f"link-{n}.md"
            link.symlink_to("/etc/passwd")
            assert [item.key for item in poll(directory(tasks))] == ["good.md"]
            link.unlink()
            assert len(sources._skipped) <= 3
    assert {path for _, path, _ in sources._skipped} == {"stays.md", "link-8.md", "link-9.md"}  # seen last
    logged = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert sum("'stays.md'" in line for line in logged) == 1  # seen every poll: never forgotten, logged once
    assert len(logged) == 11


def test_ten_thousand_names_are_remembered_and_no_more():
    source = directory("/nowhere")
    for n in range(sources.SKIPPED_CAP + 500):
        sources._skip_once(source, Path(f"link-{n}.md"), "a symbolic link")
    assert len(sources._skipped) == sources.SKIPPED_CAP == 10_000
    assert ("inbox", "link-500.md", "a symbolic link") in sources._skipped  # the oldest 500 forgotten
    assert ("inbox", "link-499.md", "a symbolic link") not in sources._skipped

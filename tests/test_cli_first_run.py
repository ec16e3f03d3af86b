"""Every command in a project where `apiary run` never ran (an apiary.yaml,
no .apiary/ yet) either works or says in one line what to run first; never a
traceback.

Works, creating the database as `apiary run` would: the README's first steps
(`apiary createsuperuser && apiary run`), the first worker credentials, a
status, a task by hand. One line, nothing created: commands about one thing
that exists only once the control plane ran (an instance, a pin, a worker).
Real `apiary` processes, as a user types them."""

import sqlite3

import pytest

from tests.daemon import apiary

CONFIG = """\
project: first-run
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: [{id: feed, type: command, command: "true", workflows: [w]}]
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    return tmp_path


def database(project):
    return project / ".apiary" / "apiary.db"


def test_createsuperuser_then_run_works_in_a_fresh_project(project):
    made = apiary(
        "createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com",
        cwd=project, DJANGO_SUPERUSER_PASSWORD="a long admin password",
    )
    assert made.returncode == 0, made.stderr
    assert "Superuser created successfully." in made.stdout
    with sqlite3.connect(database(project)) as db:
        assert db.execute("SELECT username, is_superuser FROM auth_user").fetchall() == [("admin", 1)]
    ran = apiary("run", "--until-idle", cwd=project, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr


# (arguments, what stdout shows): each creates the database and works.
WORKS = [
    (["status"], "Jobs: queued 0"),
    (["worker", "token", "list"], "no worker credentials"),
    (["worker", "token", "create", "build-1"], "apw_"),
    (["task", "add", "--title", "first", "--workflow", "w"], "dispatched: instance 1 (w)"),
]


@pytest.mark.parametrize("args, shown", WORKS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_commands_that_may_come_first_create_the_database_and_work(project, args, shown):
    result = apiary(*args, cwd=project)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert shown in result.stdout
    assert database(project).is_file()


ONE_LINE = [["cancel", "5"], ["affinity", "release", "5"], ["worker", "drain", "build-1"], ["worker", "undrain", "build-1"]]


@pytest.mark.parametrize("args", ONE_LINE, ids=" ".join)
def test_commands_about_something_that_cannot_exist_yet_say_what_to_run_first(project, args):
    result = apiary(*args, cwd=project)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert "no queue database yet" in result.stderr
    assert f"`apiary run --config {project / 'apiary.yaml'}` creates it" in result.stderr
    assert not (project / ".apiary").exists()  # nothing made just to say so


NO_CONFIG = [["status"], ["cancel", "5"], ["worker", "token", "list"], ["createsuperuser", "--noinput", "--username", "a"]]


@pytest.mark.parametrize("args", NO_CONFIG, ids=" ".join)
def test_with_no_config_anywhere_nothing_is_created_and_the_line_says_so(tmp_path, args):
    result = apiary(*args, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"no config at {tmp_path / 'apiary.yaml'}: pass --config PATH" in result.stderr
    assert not (tmp_path / ".apiary").exists()


def test_djangos_own_commands_say_what_to_run_first_too(project):
    result = apiary("changepassword", "admin", cwd=project)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("apiary: cannot use the database (")
    assert "`apiary run` or `apiary migrate` creates it" in result.stderr

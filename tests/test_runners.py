"""Runner adapters with real processes: fake `codex`/`claude` on PATH, process groups, timeouts, cancel."""

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.waiting import wait_for
from workers.pgroups import kill_process_group, process_group_alive, process_start_time
from workflows import runners
from workflows.config import AgentConfig
from workflows.runners import (
    available_adapters,
    build_prompt_command,
    build_run_command,
    printable,
    run_step,
)

FAKES = Path(__file__).parent / "fakes"
pytestmark = pytest.mark.processes
WAIT = 10.0  # the deadline of each wait in this file


def agent(runner, **fields):
    return AgentConfig(id="a", runner=runner, adapter=runners.ADAPTER_OF[runner], **fields)


def group_gone(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def env(tmp_path):
    """A child environment with the fake agents first on PATH."""
    return {
        "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}",
        "FAKE_AGENT_RECORD": str(tmp_path / "record.json"),
        "APIARY_JOB_ID": "42",
    }


def step(argv, tmp_path, env, *, stdin=None, timeout=None, cancel=None, grace=0.5, on_spawn=None, **kw):
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    return run_step(
        argv,
        cwd=workspace,
        env=env,
        stdin=stdin,
        log_path=tmp_path / "logs" / "inst" / "step.log",
        timeout=timeout,
        cancel=cancel or threading.Event(),
        grace=grace,
        on_spawn=on_spawn,
        **kw,
    )


# --- command lines ---------------------------------------------------------------------------------


def test_available_adapters_follow_path(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "sh").symlink_to("/bin/sh")
    assert available_adapters(str(bare)) == {"shell"}
    assert available_adapters(f"{FAKES}{os.pathsep}{bare}") == {"shell", "codex-cli", "claude-code"}
    (bare / "claude").symlink_to(FAKES / "claude")
    assert available_adapters(str(bare)) == {"shell", "claude-code"}


def test_prompt_is_one_argument_after_double_dash():
    prompt = "--dangerously-bypass; $(rm -rf /)\nresume"
    assert build_prompt_command(agent("codex", model="gpt-5"), prompt) == (
        ["codex", "exec", "--skip-git-repo-check", "--model", "gpt-5", "--", prompt],
        None,
        {},
    )
    assert build_prompt_command(agent("codex"), prompt)[0] == ["codex", "exec", "--skip-git-repo-check", "--", prompt]
    assert build_prompt_command(agent("claude", model="opus"), prompt)[0] == [
        "claude",
        "-p",
        "--model",
        "opus",
        "--",
        prompt,
    ]
    assert build_prompt_command(agent("claude"), prompt)[0] == ["claude", "-p", "--", prompt]


def test_shell_agent_command_forms():
    assert build_prompt_command(agent("shell", command="cat > out"), "hi") == (
        ["sh", "-c", "cat > out"],
        "hi",
        {"APIARY_PROMPT": "hi"},
    )
    assert build_prompt_command(agent("shell", command=("tee", "x")), "hi")[0] == ["tee", "x"]
    with pytest.raises(ValueError, match="no command"):
        build_prompt_command(agent("shell"), "hi")
    assert build_run_command("make test") == ["sh", "-c", "make test"]


@pytest.mark.parametrize("runner, name", [("codex", "codex"), ("claude", "claude")])
def test_fake_agent_sees_exact_invocation_cwd_and_env(tmp_path, env, runner, name):
    prompt = "- fix the bug in 'login'\n$(whoami)"
    argv, stdin, extra = build_prompt_command(agent(runner, model="m1"), prompt)
    env = {**env, **extra, "FAKE_AGENT_STDOUT": "final answer\n"}
    result = step(argv, tmp_path, env, stdin=stdin)
    assert result.status == "succeeded" and result.exit_code == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["name"] == name
    assert record["argv"] == argv[1:]
    assert record["argv"][-1] == prompt
    assert record["cwd"] == str(tmp_path / "ws")
    assert record["stdin"] == ""  # /dev/null: nothing piped in as extra context
    assert record["env"]["APIARY_JOB_ID"] == "42"
    assert record["pgid"] == record["pid"]  # leads its own process group
    assert result.output == "final answer\n"  # stdout only: the agent's progress on stderr stays out
    assert f"{name}: working" in result.output_tail
    log = Path(result.log_path).read_text()
    assert "final answer" in log and f"{name}: working" in log


def test_shell_agent_gets_prompt_on_stdin_and_in_environment(tmp_path, env):
    prompt = "line one\n'quoted' $HOME\n"
    argv, stdin, extra = build_prompt_command(
        agent("shell", command='cat > stdin.txt; printf %s "$APIARY_PROMPT" > env.txt'), prompt
    )
    result = step(argv, tmp_path, {**env, **extra}, stdin=stdin)
    assert result.status == "succeeded"
    assert (tmp_path / "ws" / "stdin.txt").read_text() == prompt
    assert (tmp_path / "ws" / "env.txt").read_text() == prompt


def test_large_prompt_on_stdin_does_not_deadlock(tmp_path, env):
    prompt = "x" * (3 * 1024 * 1024)  # far beyond a pipe buffer, echoed back through stdout
    result = step(["cat"], tmp_path, env, stdin=prompt, timeout=30)
    assert result.status == "succeeded"
    assert len(result.output.encode()) == runners.OUTPUT_CAP  # capped; the log keeps everything
    assert Path(result.log_path).stat().st_size == len(prompt)


# --- outcomes ----------------------------------------------------------------------------------------


def test_failure_keeps_exit_code_and_tail(tmp_path, env):
    result = step(["sh", "-c", "seq 1 5000; echo boom >&2; exit 3"], tmp_path, env, tail_bytes=100)
    assert (result.status, result.exit_code) == ("failed", 3)
    assert result.output_tail.endswith("4999\n5000\nboom\n")
    assert len(result.output_tail.encode()) <= 100
    assert result.output.startswith("1\n2\n3\n")
    assert result.ended_at >= result.started_at and result.duration >= 0


def test_missing_executable_is_a_failed_step_not_an_exception(tmp_path, env):
    result = step(["no-such-binary-xyz"], tmp_path, env)
    assert (result.status, result.exit_code) == ("failed", None)
    assert "cannot start" in result.output_tail
    assert "cannot start" in Path(result.log_path).read_text()


def test_step_output_with_nul_is_storable_at_the_source():
    assert printable(b"a\x00b\xff") == "a\ufffdb\ufffd"


def test_log_appends_across_runs(tmp_path, env):
    step(["echo", "first"], tmp_path, env)
    result = step(["echo", "second"], tmp_path, env)
    assert Path(result.log_path).read_text() == "first\nsecond\n"


def test_log_is_streamed_while_the_step_runs(tmp_path, env):
    log = tmp_path / "logs" / "inst" / "step.log"
    cancel = threading.Event()
    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.update(r=step(["sh", "-c", "echo early; sleep 60"], tmp_path, env, cancel=cancel))
    )
    runner.start()
    try:
        wait_for(lambda: log.exists() and "early" in log.read_text(), timeout=WAIT, what="streamed log line")
        assert runner.is_alive()  # the line arrived before the step ended
    finally:
        cancel.set()
        runner.join(timeout=30)
    assert outcome["r"].status == "cancelled"


def test_timeout_stops_the_step(tmp_path, env):
    groups = []
    result = step(["sh", "-c", "sleep 60 & sleep 60"], tmp_path, env, timeout=0.5, on_spawn=groups.append)
    assert result.status == "timed_out"
    assert result.exit_code == -signal.SIGTERM
    assert "timed out" in Path(result.log_path).read_text()
    wait_for(lambda: group_gone(groups[0]), timeout=WAIT, what="timed-out group to disappear")


def test_cancel_kills_the_whole_process_group(tmp_path, env):
    """The fake codex starts a background `sleep` in its group and sleeps; cancel ends both."""
    cancel = threading.Event()
    groups = []
    outcome = {}
    argv, stdin, _ = build_prompt_command(agent("codex"), "work")
    env = {**env, "FAKE_AGENT_SLEEP": "60"}
    runner = threading.Thread(
        target=lambda: outcome.update(r=step(argv, tmp_path, env, stdin=stdin, cancel=cancel, on_spawn=groups.append))
    )
    runner.start()
    try:
        wait_for(lambda: (tmp_path / "record.json").exists(), timeout=WAIT, what="fake codex to start")
        pgid = groups[0]
        wait_for(lambda: len(_live_members(pgid)) >= 2, timeout=WAIT, what="fake codex and its sleep child")
        cancel.set()
        runner.join(timeout=30)
    finally:
        cancel.set()
    assert outcome["r"].status == "cancelled"
    assert json.loads((tmp_path / "record.json").read_text())["pgid"] == pgid
    wait_for(lambda: group_gone(pgid), timeout=WAIT, what="no process of the cancelled group left")


def test_cancel_of_sh_with_background_child(tmp_path, env):
    cancel = threading.Event()
    groups = []
    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.update(
            r=step(["sh", "-c", "sleep 60 & sleep 60"], tmp_path, env, cancel=cancel, on_spawn=groups.append)
        )
    )
    runner.start()
    wait_for(lambda: groups and len(_live_members(groups[0])) >= 2, timeout=WAIT, what="sh and its sleeps")
    cancel.set()
    runner.join(timeout=30)
    assert outcome["r"].status == "cancelled"
    wait_for(lambda: group_gone(groups[0]), timeout=WAIT, what="no process of the cancelled group left")


def test_process_ignoring_sigterm_is_killed_after_grace(tmp_path, env):
    groups = []
    script = "trap '' TERM; echo ready; while :; do sleep 0.05; done"
    result = step(["sh", "-c", script], tmp_path, env, timeout=0.3, grace=0.5, on_spawn=groups.append)
    assert result.status == "timed_out"
    assert result.exit_code == -signal.SIGKILL
    wait_for(lambda: group_gone(groups[0]), timeout=WAIT, what="SIGKILLed group to disappear")


def test_background_child_left_by_a_finished_step_is_ended(tmp_path, env):
    groups = []
    result = step(["sh", "-c", "sleep 60 & echo done"], tmp_path, env, on_spawn=groups.append, timeout=30)
    assert (result.status, result.output) == ("succeeded", "done\n")
    wait_for(lambda: group_gone(groups[0]), timeout=WAIT, what="leftover child to be ended")


def test_already_cancelled_step_does_not_start(tmp_path, env):
    cancel = threading.Event()
    cancel.set()
    result = step(["sh", "-c", "touch started"], tmp_path, env, cancel=cancel)
    assert (result.status, result.exit_code) == ("cancelled", None)
    assert not (tmp_path / "ws" / "started").exists()


# --- what a successor uses -------------------------------------------------------------------------


def test_kill_process_group_of_an_orphaned_group(tmp_path):
    """What a successor does with a recorded group: check it is the same, then end it."""
    import subprocess

    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & sleep 60"], start_new_session=True)
    try:
        pgid = proc.pid
        started = process_start_time(pgid)
        wait_for(lambda: len(_live_members(pgid)) >= 3, timeout=WAIT, what="the group to be running")
        assert process_group_alive(pgid)
        assert kill_process_group(pgid, 5.0, leader_started=started + 1) is False  # a different process now
        assert process_group_alive(pgid)
        threading.Thread(target=proc.wait, daemon=True).start()  # reap the leader like init would
        assert kill_process_group(pgid, 0.3, leader_started=started) is True
        assert not process_group_alive(pgid)
        wait_for(lambda: group_gone(pgid), timeout=WAIT, what="group to disappear")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_kill_process_group_of_a_vanished_group_is_a_no_op():
    import subprocess

    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    assert process_group_alive(proc.pid) is False
    assert kill_process_group(proc.pid, 0.1) is True


def _live_members(pgid):
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                raw = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members.append(int(name))
    return members

"""Live step logs end to end (issue 11, item 3): a remote `apiary worker`
process streams its running step's output to the control plane, where it is
in the database before the step ends; `apiary logs` prints it locally and
through the protocol, and `apiary logs -f` (a process of its own) follows it
until the step ends. Fixtures: tests/remote/conftest.py (the `-hold` step
prints "started …", then waits for its gate)."""

import os
import subprocess
import threading

import pytest

from .conftest import ALPHA, CANARY, WAIT, ControlPlane, clean_env, command, wait_for

pytestmark = pytest.mark.processes


def on_control_plane(cp: ControlPlane, job_id: int) -> str:
    """The log text the control plane keeps for the job (every stream), from its database."""
    rows = cp.rows(
        "SELECT c.text FROM queue_logchunk c JOIN queue_logstream s ON s.id = c.stream_id"
        " WHERE s.job_id = ? ORDER BY s.id, c.offset",
        job_id,
    )
    return "".join(row["text"] for row in rows)


def token_file(cp: ControlPlane):
    path = cp.root / "elsewhere" / "token"
    path.write_text(CANARY + "\n")
    os.chmod(path, 0o600)
    return path


def remote(cp: ControlPlane, *args: str, check: bool = True):
    return cp.cli("logs", *args, "--control-plane", cp.url, "--token-file", str(token_file(cp)), config=False,
                  cwd=cp.root / "elsewhere", check=check)  # fmt: skip


def test_a_remote_workers_running_step_is_on_the_control_plane_and_apiary_logs_follows_it_to_its_end(cp, workers):
    [worker] = workers.start(("logs-alpha", ALPHA))
    cp.add_task("logs-1", "anyone-hold")
    job = wait_for(lambda: cp.job("logs-1", "anyone-hold"), what="the job")
    started = "started anyone-hold attempt 1\n"
    wait_for(lambda: started in on_control_plane(cp, job["id"]), what="the running step's first line on the control plane",
             alive=(worker.proc,), context=worker.tail)  # fmt: skip
    assert cp.job("logs-1", "anyone-hold")["state"] == "leased"  # the step waits for its gate: it has not ended

    instance = str(job["instance_id"])
    header = "==> work (attempt 1, worker logs-alpha) <==\n"
    assert cp.cli("logs", instance).stdout == header + started
    assert remote(cp, instance).stdout == header + started

    follower = subprocess.Popen(
        command("logs", instance, "--step", "work", "-f", "--control-plane", cp.url, "--token-file", str(token_file(cp))),
        cwd=cp.root / "elsewhere", env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout), daemon=True)
    try:
        reader.start()
        wait_for(lambda: started in lines, what="`apiary logs -f` to print the running step's line", alive=(follower,))
        assert follower.poll() is None  # following: the step has not ended
        cp.open_gate("logs-1")
        assert follower.wait(timeout=WAIT) == 0, follower.stderr.read()
        reader.join(WAIT)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert "".join(lines) == started + "ran anyone-hold on logs-alpha attempt 1\n"
    done = wait_for(lambda: cp.all_done("logs-1"), what="the job to end")[0]
    assert done["state"] == "succeeded"


def test_apiary_logs_names_bad_input_in_one_line(cp):
    for result in (cp.cli("logs", "999999", check=False), remote(cp, "999999", check=False)):
        assert result.returncode == 1 and result.stderr.strip() == "CommandError: there is no workflow instance 999999"
    cp.add_task("logs-bad", "anyone-quick")
    job = wait_for(lambda: cp.job("logs-bad", "anyone-quick"), what="the job")
    for result in (cp.cli("logs", str(job["instance_id"]), "--step", "nope", check=False),
                   remote(cp, str(job["instance_id"]), "--step", "nope", check=False)):  # fmt: skip
        assert result.returncode == 1, result.stdout
        [line] = result.stderr.strip().splitlines()
        assert "has no log of step 'nope'" in line
    usage = cp.cli("logs", "-3", check=False)
    assert usage.returncode == 2 and "expected an id" in usage.stderr

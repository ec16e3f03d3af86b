"""`apiary status` run locally reads the database and nothing else: no worker
token, no secret a `${VAR}` would fill in. `--watch` redraws every
`--interval` seconds until Ctrl-C, which ends it with status 0 and no
traceback. Real `apiary` processes."""

import signal
import subprocess

import pytest

from tests.daemon import REPO, apiary, apiary_command, clean_env
from tests.waiting import wait_for

LISTENING = """\
project: needs-secrets
settings:
  queue:
    listen: 127.0.0.1:8799
    worker_token: ${APIARY_WORKER_TOKEN}
agents: [{id: sh, runner: shell, command: cat, env: {GH_TOKEN: "${GH_TOKEN}"}}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: []
"""
HEADER = "apiary status, every 0.1s (Ctrl-C to stop)"


@pytest.fixture
def project(tmp_path):
    (tmp_path / "apiary.yaml").write_text(LISTENING)
    return tmp_path


def test_a_local_status_needs_no_worker_token_or_other_secret(project):
    assert apiary("check", cwd=project).returncode == 2  # the variables are unset: `apiary run` would refuse
    result = apiary("status", "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert '"jobs"' in result.stdout


def test_status_watch_redraws_until_ctrl_c_then_exits_0(project):
    proc = subprocess.Popen(
        apiary_command("status", "--watch", "--interval", "0.1"),
        cwd=project, env=clean_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        seen = []

        def redrawn_twice() -> bool:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"status --watch exited ({proc.returncode}): {proc.stderr.read()}")
            seen.append(line)
            return sum(HEADER in line for line in seen) >= 2

        wait_for(redrawn_twice, timeout=60, what="two frames of status --watch", step=0)
        assert any(line.startswith("Jobs: queued 0") for line in seen)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--watch", "--json"], "--watch redraws the table"),
        (["--watch", "--interval", "0"], "--interval: expected seconds from 0.1 to 3600, got '0'"),
        (["--watch", "--interval", "nan"], "--interval: expected seconds from 0.1 to 3600, got 'nan'"),
    ],
)
def test_bad_watch_options_are_usage_errors(project, args, message):
    result = apiary("status", *args, cwd=project)
    assert result.returncode == 2
    assert message in result.stderr

"""`apiary worker` against a control plane that is down says so in one short
line per try ("cannot reach URL: connection refused", not urllib3's repr of
its whole chain), names the wait it then makes, and a signal meanwhile ends
it with status 0. A real `apiary worker` process against a closed port.
(That the named wait is the wait made: tests/workers/test_one_retry_layer.py.)"""

import re
import signal
import socket
import subprocess

from tests.daemon import REPO, apiary_command, clean_env
from tests.waiting import wait_for

CONFIG = """\
agents: [{id: sh, runner: shell, command: cat}]
workflows: [{id: w, agent: sh, steps: [{id: s, run: "true"}]}]
sources: []
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def test_a_down_control_plane_gets_one_short_honest_line_per_try(tmp_path):
    (tmp_path / "apiary.yaml").write_text(CONFIG)
    token = tmp_path / "token"
    token.write_text("t" * 40)
    token.chmod(0o600)
    url = f"http://127.0.0.1:{closed_port()}"
    proc = subprocess.Popen(
        apiary_command("worker", "--control-plane", url, "--token-file", str(token), "--id", "w1"),
        cwd=tmp_path, env=clean_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = []

        def tried_twice() -> bool:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"the worker exited ({proc.returncode}): {''.join(lines)}")
            lines.append(line)
            return sum("registration failed" in line for line in lines) >= 2

        wait_for(tried_twice, timeout=60, what="two registration tries", step=0)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    tries = [line for line in lines if "registration failed" in line]
    for line in tries:
        assert re.search(
            rf"worker w1: registration failed \(cannot reach {re.escape(url)}: connection refused\); retrying in [0-9.]+s$", line
        ), line
        assert len(line) < 200, line  # it was over 400
    assert "HTTPConnectionPool" not in "".join(lines) + rest and "Traceback" not in rest

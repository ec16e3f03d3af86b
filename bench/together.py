"""Child processes of a benchmark released together: each sets up (imports, connection),
prints READY, waits for GO on stdin, does its work, and prints one `RESULT {json}` line."""

import json
import subprocess
import sys


def run_together(module: str, specs: list[dict], *, cwd: str, what: str, timeout: float) -> list[dict]:
    """`python -m <module> <spec>` per spec; once all are READY, GO to all; their RESULTs, in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *spec_argv], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for spec_argv in specs
    ]
    try:
        for proc in procs:  # each has set up before anyone's clock starts
            line = proc.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"{what} did not get ready: {line!r} (exit {proc.poll()})")
        for proc in procs:
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        return [result_of(proc.communicate(timeout=timeout)[0], what) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def result_of(stdout: str, what: str = "child") -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"no RESULT line in {what} output: {stdout[-500:]!r}")

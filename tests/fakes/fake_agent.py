"""A stand-in for the `codex` and `claude` CLIs in tests.

It records how it was started — argv, working directory, stdin and the
APIARY_* environment — as JSON in the file named by $FAKE_AGENT_RECORD,
prints $FAKE_AGENT_STDOUT on stdout and a line on stderr, then exits with
$FAKE_AGENT_EXIT (default 0). With $FAKE_AGENT_SLEEP it first starts a
background `sleep` child in its own process group and sleeps itself, so tests
can check that cancelling a step ends the whole group.
"""

import json
import os
import subprocess
import sys
import time


def main() -> None:
    record = {
        "name": os.path.basename(sys.argv[0]),
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "stdin": sys.stdin.read() if not sys.stdin.isatty() else None,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("APIARY_", "FAKE_"))},
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
    }
    target = os.environ.get("FAKE_AGENT_RECORD")
    if target:
        with open(target + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(target + ".tmp", target)  # readers never see a half-written record
    sys.stdout.write(os.environ.get("FAKE_AGENT_STDOUT", ""))
    sys.stdout.flush()
    sys.stderr.write(f"{record['name']}: working\n")
    sys.stderr.flush()
    if os.environ.get("FAKE_AGENT_SLEEP"):
        subprocess.Popen(["sleep", os.environ["FAKE_AGENT_SLEEP"]])
        time.sleep(float(os.environ["FAKE_AGENT_SLEEP"]))
    sys.exit(int(os.environ.get("FAKE_AGENT_EXIT", "0")))


if __name__ == "__main__":
    main()

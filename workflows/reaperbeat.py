"""The reaper's beat: when the control plane last reaped expired leases.

`ControlPlane.run_once` writes it after every reap that reached the
database; `/healthz`, served by other processes (the listener's), reads it to
tell a running reaper from a daemon that is gone or stuck. A file in the state
directory, not a row: it costs no write transaction every second, and the
listener always runs beside the daemon that started it, on the same state
directory. It holds the reap's `now` from the injected clock, so a test
moves that clock instead of waiting.
"""

import datetime as dt
import os
from pathlib import Path

NAME = "reaper"


def path_of(state_dir: Path) -> Path:
    return state_dir / "run" / NAME


def record(state_dir: Path, now: dt.datetime) -> None:
    """Replace the beat atomically (a reader never sees half a timestamp)."""
    target = path_of(state_dir)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    draft = target.with_name(f".{NAME}.{os.getpid()}")
    draft.write_text(now.isoformat())
    os.replace(draft, target)


def last(state_dir: Path) -> dt.datetime | None:
    """The last reap's time, or None when there is none (or it cannot be read)."""
    try:
        return dt.datetime.fromisoformat(path_of(state_dir).read_text().strip())
    except (OSError, ValueError):
        return None

"""Durations as an operator reads them on a screen: `4s`, `3m 20s`, `2h 5m`, `3d 4h`."""

import datetime as dt


def human(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            rest = (s % size) // sub_size
            return f"{s // size}{unit}" + (f" {rest}{sub}" if rest else "")
    return f"{s}s"


def ago(at: dt.datetime | None, now: dt.datetime) -> str:
    """`12s ago` (or `in 5s` for a time still ahead); `—` for none."""
    if at is None:
        return "—"
    seconds = (now - at).total_seconds()
    return f"{human(seconds)} ago" if seconds >= 0 else f"in {human(-seconds)}"

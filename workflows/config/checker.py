"""The checking primitives: `_Checker` collects every error and warning with
its key path, and reads one value of each kind (string, id, integer,
duration, command, ...).

Each reader returns None when the value is absent or was just reported, so
the section code can fall back to a default and carry on: that is what lets
one run report every problem in the file. The underscore names are private
to the `workflows.config` package, shared by its modules.
"""

import difflib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .schema import ID_PATTERN, MAX_ID_LENGTH

_ID_RE = re.compile(ID_PATTERN + r"\Z")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DURATION_PART_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_HINT = "a duration such as 30s, 5m, 1h, 1h30m, 250ms or a number of seconds"


class _Bad:
    """Stands for a value already reported as an error, so checks further
    down stay quiet about it instead of piling up follow-on errors."""

    def __repr__(self) -> str:
        return "<invalid>"


_BAD = _Bad()


class _Interpolated(str):
    """A string produced by `${VAR}`: numbers and booleans may arrive this way
    (`max_attempts: ${ATTEMPTS:-5}`), so the checkers parse it instead of
    rejecting it as a string."""


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int | float):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return repr(str(value))
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r} ({type(value).__name__})"


def _key(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _one_of(choices: Iterable[str]) -> str:
    return ", ".join(choices)


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _seconds(value: float) -> str:
    return f"{value:g}s"


def parse_duration(value: Any) -> float:
    """Seconds from `30s`, `5m`, `1h`, `1h30m`, `250ms`, `2d` or a plain number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected {_DURATION_HINT}, got {_describe(value)}")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = None
        if seconds is None:
            parts = _DURATION_PART_RE.findall(text)
            if not text or _DURATION_PART_RE.sub("", text).strip():
                raise ValueError(f"expected {_DURATION_HINT}, got {value!r}") from None
            seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    if seconds < 0:
        raise ValueError(f"expected a duration that is not negative, got {value!r}")
    return seconds


class _Checker:
    """Collects errors and warnings while the sections are read."""

    unset_ok: tuple[str, ...] = ()  # key paths where an unset `${VAR}` is no error (loading.load)

    def __init__(self, display: str):
        self.display = display
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.failed: set[str] = set()  # key paths already reported
        # Sections with an entry whose id could not be read: a reference to an
        # id we cannot see is then not reported again as "unknown".
        self.incomplete: set[str] = set()
        # (key path, value, "${NAME}") of every value `${NAME}` took from the environment: a
        # message never shows one (it may be a token), only the variable that supplied it.
        self.hidden: list[tuple[str, str, str]] = []

    def hide(self, path: str, name: str, value: str) -> None:
        if value:
            self.hidden.append((path, value, f"${{{name}}}"))

    def _scrub(self, path: str, message: str) -> str:
        """`message` with every interpolated value replaced by its `${NAME}`: at
        the key path the error is about, whatever its length; anywhere else
        values of 4 characters or more (shorter ones would replace digits of
        unrelated numbers, and hold no secret worth the name)."""
        for where, value, reference in sorted(self.hidden, key=lambda h: -len(h[1])):
            if where == path or where.startswith(f"{path}.") or len(value) >= 4:
                for form in sorted({value, repr(value)[1:-1], json.dumps(value)[1:-1]}, key=len, reverse=True):
                    message = message.replace(form, reference)
        return message

    def error(self, path: str, message: str) -> None:
        message = self._scrub(path, message)
        self.errors.append(f"{self.display}: {path}: {message}" if path else f"{self.display}: {message}")
        self.failed.add(path)

    def warn(self, path: str, message: str) -> None:
        message = self._scrub(path, message)
        self.warnings.append(f"{self.display}: {path}: {message}" if path else f"{self.display}: {message}")

    # -- shapes

    def mapping(
        self, value: Any, path: str, allowed: Iterable[str], *, required: Iterable[str] = (), what: str = "a mapping"
    ) -> dict | None:
        """`value` as a dict with only `allowed` keys, or None (absent or reported)."""
        if value is None or value is _BAD:
            return None
        if not isinstance(value, dict):
            self.error(path, f"expected {what}, got {_describe(value)}")
            return None
        allowed = tuple(allowed)
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                self.error(_key(path, key), f"unknown key{hint}; expected one of {_one_of(allowed)}")
        for key in required:
            if value.get(key) is None and key in allowed:
                self.error(_key(path, key), "required")
        return value

    def items(self, value: Any, path: str, what: str) -> list[tuple[str, Any]]:
        """(key path, element) for a list section; absent = empty."""
        if value is None or value is _BAD:
            return []
        if not isinstance(value, list):
            self.error(path, f"expected a list of {what}, got {_describe(value)}")
            return []
        return [(f"{path}[{i}]", element) for i, element in enumerate(value)]

    # -- scalars; each returns None when absent or already reported

    def string(self, value: Any, path: str, *, empty_is_absent: bool = False) -> str | None:
        if value is None or value is _BAD:
            return None
        if not isinstance(value, str):
            self.error(path, f"expected a string, got {_describe(value)}")
            return None
        if value == "":
            if not empty_is_absent:
                self.error(path, "expected a non-empty string")
            return None
        return str(value)

    def identifier(self, value: Any, path: str, *, what: str = "an id") -> str | None:
        text = self.string(value, path)
        if text is None:
            return None
        if not _ID_RE.match(text):
            self.error(path, f"expected {what} matching {ID_PATTERN}, got {text!r}")
            return None
        if len(text) > MAX_ID_LENGTH:
            self.error(path, f"expected {what} of at most {MAX_ID_LENGTH} characters, got {len(text)}")
            return None
        return text

    def word(self, value: Any, path: str, *, what: str, empty_is_absent: bool = False) -> str | None:
        """A non-empty string without whitespace: labels, capabilities, pool names."""
        text = self.string(value, path, empty_is_absent=empty_is_absent)
        if text is not None and (text.split() != [text] or len(text) > MAX_ID_LENGTH):
            self.error(path, f"expected {what} without spaces, of at most {MAX_ID_LENGTH} characters, got {text!r}")
            return None
        return text

    def choice(self, value: Any, path: str, choices: Iterable[str], *, hint: Mapping[str, str] = {}) -> str | None:  # noqa: B006 - read only
        text = self.string(value, path)
        choices = tuple(choices)
        if text is not None and text not in choices:
            extra = f" (did you mean '{hint[text]}'?)" if text in hint else ""
            self.error(path, f"expected one of {_one_of(choices)}, got {text!r}{extra}")
            return None
        return text

    def integer(self, value: Any, path: str, *, minimum: int, maximum: int = 2**31 - 1) -> int | None:
        if value is None or value is _BAD:
            return None
        if isinstance(value, _Interpolated) and re.fullmatch(r"\s*-?\d+\s*", value):
            value = int(value)
        wanted = f"an integer ≥ {minimum}" if minimum >= 0 else f"an integer from {minimum} to {maximum}"
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(path, f"expected {wanted}, got {_describe(value)}")
            return None
        if value < minimum:
            self.error(path, f"expected {wanted}, got {value}")
            return None
        if value > maximum:
            self.error(path, f"expected an integer ≤ {maximum}, got {value}")
            return None
        return value

    def number(self, value: Any, path: str, *, minimum: float) -> float | None:
        if value is None or value is _BAD:
            return None
        if isinstance(value, _Interpolated) and re.fullmatch(r"\s*-?\d+(\.\d*)?\s*", value):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            self.error(path, f"expected a number ≥ {minimum:g}, got {_describe(value)}")
            return None
        if value < minimum or value == float("inf"):
            self.error(path, f"expected a finite number ≥ {minimum:g}, got {value}")
            return None
        return float(value)

    def boolean(self, value: Any, path: str) -> bool | None:
        if value is None or value is _BAD:
            return None
        if isinstance(value, _Interpolated) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            self.error(path, f"expected true or false, got {_describe(value)}")
            return None
        return value

    def duration(self, value: Any, path: str, *, allow_zero: bool = False) -> float | None:
        if value is None or value is _BAD:
            return None
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            self.error(path, str(exc))
            return None
        if seconds == 0 and not allow_zero:
            self.error(path, f"expected a duration above zero, got {value!r}")
            return None
        return seconds

    def strings(self, value: Any, path: str, *, what: str) -> tuple[str, ...]:
        """A list of words (a single string is not accepted: `[linux]`, not `linux`)."""
        out: list[str] = []
        for item_path, item in self.items(value, path, f"{what}s"):
            word = self.word(item, item_path, what=what)
            if word is not None and word not in out:
                out.append(word)
        return tuple(out)

    def env(self, value: Any, path: str) -> dict[str, str]:
        if value is None or value is _BAD:
            return {}
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping of environment variable names to strings, got {_describe(value)}")
            return {}
        env = {}
        for name, raw in value.items():
            item_path = _key(path, name)
            if not isinstance(name, str) or not _ENV_NAME_RE.match(name):
                self.error(
                    item_path,
                    f"expected an environment variable name matching [A-Za-z_][A-Za-z0-9_]*, got {_describe(name)}",
                )
                continue
            if raw is _BAD:
                continue
            # Numbers are common in env blocks (`DEBUG: 1`) and have one obvious string form.
            if isinstance(raw, int | float) and not isinstance(raw, bool):
                raw = str(raw)
            if not isinstance(raw, str):
                self.error(item_path, f"expected a string, got {_describe(raw)}")
                continue
            env[name] = str(raw)
        return env

    def command(self, value: Any, path: str) -> str | tuple[str, ...] | None:
        """A string (run by `sh -c`) or a non-empty list of strings (an argv)."""
        if value is None or value is _BAD:
            return None
        if isinstance(value, str):
            return self.string(value, path)
        if isinstance(value, list):
            if not value:
                self.error(path, "expected a non-empty argv list or a shell string, got an empty list")
                return None
            argv = [self.string(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return tuple(argv) if all(arg is not None for arg in argv) else None
        self.error(path, f"expected a shell string or an argv list of strings, got {_describe(value)}")
        return None

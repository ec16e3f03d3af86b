"""Find apiary.yaml and turn it into a `Config`: read the file (at most
CONFIG_CAP bytes), parse YAML (workflows.yamlload: no anchors or aliases, no
duplicate keys), interpolate `${VAR}`, then hand over to the
section checkers.

Only a file that cannot be read or parsed at all stops early (there is nothing
to check); from interpolation on, problems are collected by one `_Checker` and
raised together.
"""

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from .. import yamlload
from .checker import _BAD, _Checker, _describe, _Interpolated, _key
from .schema import Config
from .sections import _build

DEFAULT_CONFIG_NAME = "apiary.yaml"
CONFIG_CAP = 1024 * 1024  # bytes of apiary.yaml read at most; a larger file is refused unparsed


class ConfigError(Exception):
    """Every problem found in one config file, one message per entry."""

    def __init__(self, errors: Iterable[str] | str):
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)


def find_config_path(explicit: str | None = None) -> Path:
    """`--config`, then `$APIARY_CONFIG`, then `./apiary.yaml`; a directory means its apiary.yaml."""
    if explicit:
        candidate, origin = Path(explicit), "--config"
    elif os.environ.get("APIARY_CONFIG"):
        candidate, origin = Path(os.environ["APIARY_CONFIG"]), "$APIARY_CONFIG"
    else:
        candidate, origin = Path(DEFAULT_CONFIG_NAME), "the current directory"
    candidate = Path(os.path.abspath(candidate.expanduser()))
    if candidate.is_dir():
        candidate = candidate / DEFAULT_CONFIG_NAME
    if not candidate.is_file():
        raise ConfigError(
            f"{candidate}: config file not found (from {origin}; "
            f"looked at --config, then $APIARY_CONFIG, then ./{DEFAULT_CONFIG_NAME})"
        )
    return candidate


def load(path: Path | str, *, environ: Mapping[str, str] | None = None, unset_ok: Iterable[str] = ()) -> Config:
    """Read and check `path`; raises ConfigError listing every problem found.

    `unset_ok` is for commands that never use what some `${VAR}`s fill in: key
    paths ("settings.queue"; "" for the whole file) under which an unset
    variable leaves its key as if it were absent, with no error about it or
    about what needed it. A remote worker ignores the queue settings (the
    listener's worker token); a local `apiary status` uses no secret at all."""
    display = str(path)
    absolute = Path(os.path.abspath(Path(path).expanduser()))
    try:
        with open(absolute, "rb") as file:
            data = file.read(CONFIG_CAP + 1)
        if len(data) > CONFIG_CAP:
            raise ConfigError(f"{display}: larger than {CONFIG_CAP} bytes (CONFIG_CAP); is this the config file?")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{display}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{display}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{display}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{display}: cannot read ({exc.strerror})") from None
    try:
        raw = yamlload.load(text)  # no anchors or aliases, no duplicate keys, bounded depth
    except yaml.YAMLError as exc:
        raise ConfigError(f"{display}: {yamlload.problem(exc)}") from None
    if raw is None:
        raise ConfigError(f"{display}: the file is empty; expected a mapping with agents, workflows and sources")
    if not isinstance(raw, dict):
        raise ConfigError(f"{display}: expected a mapping at the top level, got {_describe(raw)}")
    check = _Checker(display)
    check.unset_ok = tuple(unset_ok)
    tree = _interpolate(check, raw, "", os.environ if environ is None else environ)
    config = _build(check, tree, absolute)
    if check.errors:
        raise ConfigError(check.errors)
    return config


# --------------------------------------------------------------------------- ${VAR} interpolation
# Done on the parsed tree, not the text, so a value can never inject YAML
# structure, and each problem is reported at the key path of its string.


def _interpolate(check: _Checker, value: Any, path: str, environ: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(check, v, _key(path, k), environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(check, v, f"{path}[{i}]", environ) for i, v in enumerate(value)]
    if isinstance(value, str) and "$" in value:
        return _interpolate_string(check, value, path, environ)
    return value


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(not p or path == p or path.startswith((f"{p}.", f"{p}[")) for p in prefixes)


def _interpolate_string(check: _Checker, text: str, path: str, environ: Mapping[str, str]) -> Any:
    """`${NAME}` and `${NAME:-default}` (default when unset or empty); `$${` is a literal `${`.

    A lone `$` is left alone so shell commands keep `$HOME` or `$$`.
    """
    out: list[str] = []
    problems: list[str] = []
    unset = False
    substituted = False
    i = 0
    while (j := text.find("$", i)) >= 0:
        out.append(text[i:j])
        if text.startswith("$${", j):
            out.append("${")
            i = j + 3
            continue
        if not text.startswith("${", j):
            out.append("$")
            i = j + 1
            continue
        end = text.find("}", j + 2)
        if end < 0:
            problems.append(f"unterminated '${{' in {text!r}; expected ${{NAME}} or ${{NAME:-default}}")
            i = len(text)
            break
        expression = text[j + 2 : end]
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", expression, re.DOTALL)
        if not match or "${" in (match.group(2) or ""):
            problems.append(f"malformed '${{{expression}}}'; expected ${{NAME}} or ${{NAME:-default}}")
        else:
            name, default = match.group(1), match.group(2)
            found = environ.get(name)
            if found:
                check.hide(path, name, found)  # an error about this value names ${NAME}, never the value
            if default is not None and not found:
                found = default
            if found is None and _under(path, check.unset_ok):
                unset = True
            elif found is None:
                problems.append(
                    f"environment variable {name} is not set (give a default with ${{{name}:-value}}, "
                    f"or write $${{{name}}} for a literal '${{{name}}}')"
                )
            out.append(found or "")
        substituted = True
        i = end + 1
    out.append(text[i:])
    for problem in problems:
        check.error(path, problem)
    if problems:
        return _BAD
    if unset:  # under `unset_ok`: quiet, as an error already reported would be
        check.failed.add(path)
        return _BAD
    return _Interpolated("".join(out)) if substituted else "".join(out)

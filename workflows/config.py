"""apiary.yaml: find it, read it, check every key, and build a frozen `Config`.

The loader never stops at the first problem: it walks the whole file, collects
every error (each naming the file, the key path such as `agents[1].runner`,
and what was expected) and raises one `ConfigError` carrying them all, so a
user fixes a file in one round trip. Problems that do not stop Apiary from
running (a source folder that does not exist yet, a heartbeat close to the
lease) become `Config.warnings`.

Order of work: YAML (duplicate keys rejected) → `${VAR}` interpolation over
every string value → one checker per section → cross-checks between sections.
"""

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from jobqueue import conf

# runner (what the user writes) -> adapter (what workers advertise as `runner:<adapter>`)
RUNNERS = {"codex": "codex-cli", "claude": "claude-code", "shell": "shell"}
ADAPTERS = tuple(RUNNERS.values())
_ADAPTER_TO_RUNNER = {adapter: runner for runner, adapter in RUNNERS.items() if adapter != runner}
SOURCE_TYPES = ("directory", "command")
ID_PATTERN = "[A-Za-z0-9][A-Za-z0-9._-]*"
MAX_ID_LENGTH = 128  # the queue's CharField width for ids used as limit keys
DEFAULT_CONFIG_NAME = "apiary.yaml"

_ID_RE = re.compile(ID_PATTERN + r"\Z")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DURATION_PART_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_HINT = "a duration such as 30s, 5m, 1h, 1h30m, 250ms or a number of seconds"


class ConfigError(Exception):
    """Every problem found in one config file, one message per entry."""

    def __init__(self, errors: Iterable[str] | str):
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))

    def __str__(self) -> str:
        return "\n".join(self.errors)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    id: str
    runner: str  # codex | claude | shell
    adapter: str  # codex-cli | claude-code | shell
    model: str | None = None
    # runner shell only: a string runs under `sh -c`, a tuple is an argv.
    command: str | tuple[str, ...] | None = None
    worker_pool: str | None = None
    requires_labels: tuple[str, ...] = ()
    requires_capabilities: tuple[str, ...] = ()
    workspace_affinity: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    id: str
    prompt: str | None = None  # exactly one of prompt / run is set
    run: str | None = None
    timeout: float | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    continue_on_error: bool = False


@dataclasses.dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 1
    backoff: float = 0.0
    backoff_max: float = 300.0


@dataclasses.dataclass(frozen=True)
class WorkflowConfig:
    id: str
    agent: str
    steps: tuple[StepConfig, ...]
    timeout: float | None = None
    retry: RetryConfig = RetryConfig()
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    id: str
    type: str  # directory | command
    workflows: tuple[str, ...]
    poll_interval: float = 30.0
    path: Path | None = None  # directory: absolute, resolved against the config file's folder
    pattern: str = "*"
    redispatch_on_change: bool = False
    command: str | tuple[str, ...] | None = None  # command: string -> sh -c, tuple -> argv


@dataclasses.dataclass(frozen=True)
class QueueSettings:
    listen: str | None = None
    worker_token: str | None = None
    embedded_worker: bool = True
    lease_duration: float = 30.0
    heartbeat_interval: float = 10.0
    worker_timeout: float = 30.0
    max_attempts: int = 5
    limits: conf.Limits = dataclasses.field(default_factory=conf.Limits)


@dataclasses.dataclass(frozen=True)
class Settings:
    concurrency: int = 2
    worker_capacity: int = 1
    queue: QueueSettings = QueueSettings()


@dataclasses.dataclass(frozen=True)
class Config:
    path: Path
    project: str
    settings: Settings = Settings()
    agents: dict[str, AgentConfig] = dataclasses.field(default_factory=dict)
    workflows: dict[str, WorkflowConfig] = dataclasses.field(default_factory=dict)
    sources: dict[str, SourceConfig] = dataclasses.field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def state_dir(self) -> Path:
        return self.path.parent / ".apiary"

    def queue_config(self) -> conf.QueueConfig:
        q = self.settings.queue
        return conf.QueueConfig(
            lease_duration=q.lease_duration,
            heartbeat_interval=q.heartbeat_interval,
            worker_timeout=q.worker_timeout,
            max_attempts=q.max_attempts,
            limits=q.limits,
        )


# --------------------------------------------------------------------------- public helpers


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


def load(path: Path | str, *, environ: Mapping[str, str] | None = None) -> Config:
    """Read and check `path`; raises ConfigError listing every problem found."""
    display = str(path)
    absolute = Path(os.path.abspath(Path(path).expanduser()))
    try:
        text = absolute.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{display}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{display}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{display}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{display}: cannot read ({exc.strerror})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: as safe as yaml.safe_load
    except yaml.YAMLError as exc:
        raise ConfigError(f"{display}: {_yaml_problem(exc)}") from None
    if raw is None:
        raise ConfigError(f"{display}: the file is empty; expected a mapping with agents, workflows and sources")
    if not isinstance(raw, dict):
        raise ConfigError(f"{display}: expected a mapping at the top level, got {_describe(raw)}")
    check = _Checker(display, os.environ if environ is None else environ)
    config = _build(check, check.interpolate(raw, ""), absolute)
    if check.errors:
        raise ConfigError(check.errors)
    return config


# --------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys: plain safe_load keeps
    the last one silently, which would hide a whole agent or setting."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` may be overridden by explicit keys; that is not a duplicate
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable key: construct_mapping reports it properly
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}invalid YAML: {problem}"


# --------------------------------------------------------------------------- checking primitives


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


class _Checker:
    """Collects errors and warnings while the sections are read."""

    def __init__(self, display: str, environ: Mapping[str, str]):
        self.display = display
        self.environ = environ
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.failed: set[str] = set()  # key paths already reported
        # Sections with an entry whose id could not be read: a reference to an
        # id we cannot see is then not reported again as "unknown".
        self.incomplete: set[str] = set()

    def error(self, path: str, message: str) -> None:
        self.errors.append(f"{self.display}: {path}: {message}" if path else f"{self.display}: {message}")
        self.failed.add(path)

    def warn(self, path: str, message: str) -> None:
        self.warnings.append(f"{self.display}: {path}: {message}" if path else f"{self.display}: {message}")

    # -- interpolation

    def interpolate(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self.interpolate(v, _key(path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.interpolate(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and "$" in value:
            return self._interpolate_string(value, path)
        return value

    def _interpolate_string(self, text: str, path: str) -> Any:
        """`${NAME}` and `${NAME:-default}` (default when unset or empty); `$${` is a literal `${`.

        A lone `$` is left alone so shell commands keep `$HOME` or `$$`.
        """
        out: list[str] = []
        problems: list[str] = []
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
                found = self.environ.get(name)
                if default is not None and not found:
                    found = default
                if found is None:
                    problems.append(
                        f"environment variable {name} is not set (give a default with ${{{name}:-value}}, "
                        f"or write $${{{name}}} for a literal '${{{name}}}')"
                    )
                out.append(found or "")
            substituted = True
            i = end + 1
        out.append(text[i:])
        for problem in problems:
            self.error(path, problem)
        if problems:
            return _BAD
        return _Interpolated("".join(out)) if substituted else "".join(out)

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


# --------------------------------------------------------------------------- sections

TOP_KEYS = ("project", "settings", "agents", "workflows", "sources")
SETTINGS_KEYS = ("concurrency", "worker_capacity", "queue")
QUEUE_KEYS = (
    "listen",
    "worker_token",
    "embedded_worker",
    "lease_duration",
    "heartbeat_interval",
    "worker_timeout",
    "max_attempts",
    "concurrency",
)
CONCURRENCY_KEYS = tuple(f"default_{d}" for d in conf.DIMENSIONS) + tuple(conf.PLURAL[d] for d in conf.DIMENSIONS)
AGENT_KEYS = (
    "id",
    "runner",
    "model",
    "command",
    "worker_pool",
    "requires_labels",
    "requires_capabilities",
    "workspace_affinity",
    "env",
)
WORKFLOW_KEYS = ("id", "agent", "steps", "timeout", "retry", "priority")
STEP_KEYS = ("id", "prompt", "run", "timeout", "env", "continue_on_error")
RETRY_KEYS = ("max_attempts", "backoff", "backoff_max")
SOURCE_KEYS = ("id", "type", "workflows", "poll_interval", "path", "pattern", "redispatch_on_change", "command")
_SOURCE_TYPE_KEYS = {"directory": ("path", "pattern", "redispatch_on_change"), "command": ("command",)}


def _build(check: _Checker, raw: dict, path: Path) -> Config:
    check.mapping(raw, "", TOP_KEYS)
    project = path.parent.name or "default"
    if raw.get("project") is not None:
        project = check.identifier(raw["project"], "project", what="a project name") or project
    agents = _agents(check, raw.get("agents"))
    workflows = _workflows(check, raw.get("workflows"), agents)
    sources = _sources(check, raw.get("sources"), workflows, path.parent)
    settings = _settings(check, raw.get("settings"), project=project, agents=agents, sources=sources)
    return Config(
        path=path,
        project=project,
        settings=settings,
        agents=agents,
        workflows=workflows,
        sources=sources,
        warnings=tuple(check.warnings),
    )


def _default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def _settings(
    check: _Checker, raw: Any, *, project: str, agents: Mapping[str, AgentConfig], sources: Mapping[str, SourceConfig]
) -> Settings:
    section = check.mapping(raw, "settings", SETTINGS_KEYS) or {}
    concurrency = _default(check.integer(section.get("concurrency"), "settings.concurrency", minimum=0), 2)
    capacity = _default(check.integer(section.get("worker_capacity"), "settings.worker_capacity", minimum=1), 1)
    queue = _queue(
        check, section.get("queue"), concurrency=concurrency, project=project, agents=agents, sources=sources
    )
    return Settings(concurrency=concurrency, worker_capacity=capacity, queue=queue)


def _queue(
    check: _Checker,
    raw: Any,
    *,
    concurrency: int,
    project: str,
    agents: Mapping[str, AgentConfig],
    sources: Mapping[str, SourceConfig],
) -> QueueSettings:
    p = "settings.queue"
    section = check.mapping(raw, p, QUEUE_KEYS) or {}
    listen = check.string(section.get("listen"), f"{p}.listen", empty_is_absent=True)
    if listen is not None and not _valid_listen(listen):
        check.error(f"{p}.listen", f"expected host:port (such as 0.0.0.0:8080), got {listen!r}")
    token = check.string(section.get("worker_token"), f"{p}.worker_token", empty_is_absent=True)
    if listen is not None and token is None and f"{p}.worker_token" not in check.failed:
        check.error(f"{p}.worker_token", "required when settings.queue.listen is set (workers authenticate with it)")
    elif token is not None and len(token) < 16:
        check.warn(f"{p}.worker_token", f"only {len(token)} characters; use a long random token (32+ characters)")
    embedded = _default(check.boolean(section.get("embedded_worker"), f"{p}.embedded_worker"), True)
    if not embedded and listen is None and f"{p}.listen" not in check.failed:
        check.warn(f"{p}.embedded_worker", "false and settings.queue.listen is not set: no worker can run any job")
    lease = check.duration(section.get("lease_duration"), f"{p}.lease_duration")
    heartbeat = check.duration(section.get("heartbeat_interval"), f"{p}.heartbeat_interval")
    timeout = check.duration(section.get("worker_timeout"), f"{p}.worker_timeout")
    # Cross-checks only between values that were read correctly (or defaulted).
    lease_ok = f"{p}.lease_duration" not in check.failed
    heartbeat_ok = f"{p}.heartbeat_interval" not in check.failed
    timeout_ok = f"{p}.worker_timeout" not in check.failed
    lease, heartbeat, timeout = _default(lease, 30.0), _default(heartbeat, 10.0), _default(timeout, 30.0)
    if lease_ok and heartbeat_ok:
        if heartbeat >= lease:
            heartbeat_ok = False  # the heartbeat is the value to fix; do not also blame worker_timeout
            check.error(
                f"{p}.heartbeat_interval",
                f"expected less than lease_duration ({_seconds(lease)}), got {_seconds(heartbeat)}; "
                "every lease would run out between two heartbeats",
            )
        elif heartbeat > lease / 2:
            check.warn(
                f"{p}.heartbeat_interval",
                f"{_seconds(heartbeat)} is more than half of lease_duration ({_seconds(lease)}); "
                "one late heartbeat loses the lease (a third of it or less is comfortable)",
            )
    if heartbeat_ok and timeout_ok and timeout <= heartbeat:
        check.error(
            f"{p}.worker_timeout",
            f"expected more than heartbeat_interval ({_seconds(heartbeat)}), got {_seconds(timeout)}; "
            "healthy workers would look stale",
        )
    max_attempts = _default(check.integer(section.get("max_attempts"), f"{p}.max_attempts", minimum=1), 5)
    limits = _limits(
        check, section.get("concurrency"), concurrency=concurrency, project=project, agents=agents, sources=sources
    )
    return QueueSettings(
        listen=listen,
        worker_token=token,
        embedded_worker=embedded,
        lease_duration=lease,
        heartbeat_interval=heartbeat,
        worker_timeout=timeout,
        max_attempts=max_attempts,
        limits=limits,
    )


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _valid_listen(listen: str) -> bool:
    host, sep, port = listen.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535 and not any(c.isspace() for c in listen))


def _limits(
    check: _Checker,
    raw: Any,
    *,
    concurrency: int,
    project: str,
    agents: Mapping[str, AgentConfig],
    sources: Mapping[str, SourceConfig],
) -> conf.Limits:
    """Defaults and keyed overrides per dimension. The project default is
    `default_project` when given (even 0 = unlimited), else settings.concurrency."""
    p = "settings.queue.concurrency"
    section = check.mapping(raw, p, CONCURRENCY_KEYS) or {}
    defaults: dict[str, int] = {}
    overrides: dict[str, dict[str, int]] = {}
    pools = {a.worker_pool for a in agents.values() if a.worker_pool}
    # Which keys can ever meet a job, per dimension (and the section they come
    # from): a limit on any other key never applies.
    reachable: dict[str, tuple[Iterable[str], str, str]] = {
        "project": ((project,), "the project is", ""),
        "agent": (agents, "agents are", "agents"),
        "source": (sources, "sources are", "sources"),
        "pool": (pools, "pools used by agents are", "agents"),
    }
    for dim in conf.DIMENSIONS:
        key = f"default_{dim}"
        value = check.integer(section.get(key), f"{p}.{key}", minimum=0)
        defaults[dim] = _default(value, concurrency if dim == "project" else 0)
        plural = conf.PLURAL[dim]
        keyed = section.get(plural)
        if keyed is None or keyed is _BAD:
            overrides[dim] = {}
            continue
        if not isinstance(keyed, dict):
            check.error(f"{p}.{plural}", f"expected a mapping of {dim} names to limits, got {_describe(keyed)}")
            overrides[dim] = {}
            continue
        overrides[dim] = {}
        for name, limit in keyed.items():
            item_path = f"{p}.{plural}.{name}"
            if dim == "runner":
                wanted = check.choice(name, item_path, ADAPTERS, hint=RUNNERS)
                if wanted is None:
                    continue
            elif check.word(name, item_path, what=f"a {dim} name") is None:
                continue
            number = check.integer(limit, item_path, minimum=0)
            if number is None:
                continue
            overrides[dim][name] = number
            if dim in reachable:
                known, label, origin = reachable[dim]
                known = tuple(known)
                if name not in known and origin not in check.incomplete:
                    listing = _one_of(known) if known else "none"
                    check.warn(item_path, f"no {dim} is called {name!r} ({label}: {listing}); this limit never applies")
    return conf.Limits(defaults=defaults, overrides=overrides)


def _unique_id(check: _Checker, entry: dict, path: str, seen: dict[str, str], *, kind: str, section: str) -> str | None:
    """The entry's id, reported when invalid or already used by an earlier entry of the same kind."""
    article = "an" if kind[0] in "aeiou" else "a"
    ident = check.identifier(entry.get("id"), f"{path}.id", what=f"{article} {kind} id")
    if ident is None:
        check.incomplete.add(section)
    if ident is not None and ident in seen:
        check.error(f"{path}.id", f"duplicate {kind} id {ident!r} (first used at {seen[ident]})")
        return None
    if ident is not None:
        seen[ident] = path
    return ident


def _entries(check: _Checker, raw: Any, section: str, what: str) -> Iterable[tuple[str, dict]]:
    if raw is _BAD or (raw is not None and not isinstance(raw, list)):
        check.incomplete.add(section)
    for path, element in check.items(raw, section, what):
        if not isinstance(element, dict):
            check.incomplete.add(section)
            if element is not _BAD:
                check.error(path, f"expected a mapping (one {what[:-1]}), got {_describe(element)}")
            continue
        yield path, element


def _agents(check: _Checker, raw: Any) -> dict[str, AgentConfig]:
    agents: dict[str, AgentConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "agents", "agents"):
        check.mapping(entry, path, AGENT_KEYS, required=("id", "runner"))
        ident = _unique_id(check, entry, path, seen, kind="agent", section="agents")
        runner = check.choice(entry.get("runner"), f"{path}.runner", RUNNERS, hint=_ADAPTER_TO_RUNNER)
        model = check.string(entry.get("model"), f"{path}.model", empty_is_absent=True)
        command = check.command(entry.get("command"), f"{path}.command")
        if runner == "shell":
            if model is not None:
                check.error(f"{path}.model", "not used by runner shell (it runs `command`); remove it")
            if command is None and f"{path}.command" not in check.failed:
                check.error(f"{path}.command", "required for runner shell (a shell string or an argv list)")
        elif runner is not None and entry.get("command") is not None:
            check.error(f"{path}.command", f"only used by runner shell; runner {runner} runs its own CLI")
        agent = AgentConfig(
            id=ident or "",
            runner=runner or "",
            adapter=RUNNERS.get(runner or "", ""),
            model=model,
            command=command,
            worker_pool=check.word(
                entry.get("worker_pool"), f"{path}.worker_pool", what="a pool name", empty_is_absent=True
            ),
            requires_labels=check.strings(entry.get("requires_labels"), f"{path}.requires_labels", what="label"),
            requires_capabilities=check.strings(
                entry.get("requires_capabilities"), f"{path}.requires_capabilities", what="capability"
            ),
            workspace_affinity=_default(
                check.boolean(entry.get("workspace_affinity"), f"{path}.workspace_affinity"), False
            ),
            env=check.env(entry.get("env"), f"{path}.env"),
        )
        if ident is not None:
            agents[ident] = agent
    return agents


def _known(kind: str, ident: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(ident, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    listing = f"known {kind}s: {_one_of(known)}" if known else f"no {kind}s are defined"
    return f"unknown {kind} {ident!r}{hint}; {listing}"


def _workflows(check: _Checker, raw: Any, agents: Mapping[str, AgentConfig]) -> dict[str, WorkflowConfig]:
    workflows: dict[str, WorkflowConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "workflows", "workflows"):
        check.mapping(entry, path, WORKFLOW_KEYS, required=("id", "agent", "steps"))
        ident = _unique_id(check, entry, path, seen, kind="workflow", section="workflows")
        agent = check.identifier(entry.get("agent"), f"{path}.agent", what="an agent id")
        if agent is not None and agent not in agents and "agents" not in check.incomplete:
            check.error(f"{path}.agent", _known("agent", agent, agents))
        steps = _steps(check, entry.get("steps"), f"{path}.steps")
        retry = _retry(check, entry.get("retry"), f"{path}.retry")
        workflow = WorkflowConfig(
            id=ident or "",
            agent=agent or "",
            steps=steps,
            timeout=check.duration(entry.get("timeout"), f"{path}.timeout"),
            retry=retry,
            priority=_default(check.integer(entry.get("priority"), f"{path}.priority", minimum=-(2**31)), 0),
        )
        if ident is not None:
            workflows[ident] = workflow
    return workflows


def _steps(check: _Checker, raw: Any, path: str) -> tuple[StepConfig, ...]:
    if isinstance(raw, list) and not raw:
        check.error(path, "expected at least one step")
    steps: list[StepConfig] = []
    seen: dict[str, str] = {}
    for step_path, entry in _entries(check, raw, path, "steps"):
        check.mapping(entry, step_path, STEP_KEYS, required=("id",))
        ident = _unique_id(check, entry, step_path, seen, kind="step", section=path)
        prompt = check.string(entry.get("prompt"), f"{step_path}.prompt")
        run = check.string(entry.get("run"), f"{step_path}.run")
        given = [k for k in ("prompt", "run") if entry.get(k) is not None]
        if len(given) == 2:
            check.error(
                f"{step_path}.run", "a step has either prompt (sent to the agent) or run (a shell command), not both"
            )
        elif not given:
            check.error(
                f"{step_path}.prompt", "required: a step needs prompt (sent to the agent) or run (a shell command)"
            )
        steps.append(
            StepConfig(
                id=ident or "",
                prompt=prompt,
                run=run,
                timeout=check.duration(entry.get("timeout"), f"{step_path}.timeout"),
                env=check.env(entry.get("env"), f"{step_path}.env"),
                continue_on_error=_default(
                    check.boolean(entry.get("continue_on_error"), f"{step_path}.continue_on_error"), False
                ),
            )
        )
    return tuple(steps)


def _retry(check: _Checker, raw: Any, path: str) -> RetryConfig:
    section = check.mapping(raw, path, RETRY_KEYS) or {}
    max_attempts = _default(check.integer(section.get("max_attempts"), f"{path}.max_attempts", minimum=1), 1)
    backoff = check.duration(section.get("backoff"), f"{path}.backoff", allow_zero=True)
    backoff_max = check.duration(section.get("backoff_max"), f"{path}.backoff_max", allow_zero=True)
    if backoff is not None and backoff_max is not None and backoff_max < backoff:
        check.error(
            f"{path}.backoff_max", f"expected at least backoff ({_seconds(backoff)}), got {_seconds(backoff_max)}"
        )
    return RetryConfig(
        max_attempts=max_attempts, backoff=_default(backoff, 0.0), backoff_max=_default(backoff_max, 300.0)
    )


def _sources(check: _Checker, raw: Any, workflows: Mapping[str, WorkflowConfig], base: Path) -> dict[str, SourceConfig]:
    sources: dict[str, SourceConfig] = {}
    seen: dict[str, str] = {}
    for path, entry in _entries(check, raw, "sources", "sources"):
        check.mapping(entry, path, SOURCE_KEYS, required=("id", "type", "workflows"))
        ident = _unique_id(check, entry, path, seen, kind="source", section="sources")
        kind = check.choice(entry.get("type"), f"{path}.type", SOURCE_TYPES)
        if kind is not None:
            for other, keys in _SOURCE_TYPE_KEYS.items():
                for key in keys:
                    if other != kind and entry.get(key) is not None:
                        check.error(f"{path}.{key}", f"only for sources of type {other}; this source is type {kind}")
        names = _source_workflows(check, entry.get("workflows"), f"{path}.workflows", workflows)
        poll = _default(check.duration(entry.get("poll_interval"), f"{path}.poll_interval"), 30.0)
        directory = None
        command = None
        if kind == "directory":
            directory = _source_path(check, entry.get("path"), f"{path}.path", base)
        elif kind == "command":
            command = check.command(entry.get("command"), f"{path}.command")
            if entry.get("command") is None:
                check.error(f"{path}.command", "required for a command source (a shell string or an argv list)")
        source = SourceConfig(
            id=ident or "",
            type=kind or "",
            workflows=names,
            poll_interval=poll,
            path=directory,
            pattern=_default(check.string(entry.get("pattern"), f"{path}.pattern"), "*"),
            redispatch_on_change=_default(
                check.boolean(entry.get("redispatch_on_change"), f"{path}.redispatch_on_change"), False
            ),
            command=command,
        )
        if ident is not None:
            sources[ident] = source
    return sources


def _source_workflows(check: _Checker, raw: Any, path: str, workflows: Mapping[str, WorkflowConfig]) -> tuple[str, ...]:
    if isinstance(raw, list) and not raw:
        check.error(path, "expected at least one workflow id")
    names: list[str] = []
    for item_path, item in check.items(raw, path, "workflow ids"):
        name = check.identifier(item, item_path, what="a workflow id")
        if name is None:
            continue
        if name in names:
            check.error(item_path, f"workflow {name!r} is listed twice")
        elif name not in workflows and "workflows" not in check.incomplete:
            check.error(item_path, _known("workflow", name, workflows))
        else:
            names.append(name)
    return tuple(names)


def _source_path(check: _Checker, raw: Any, path: str, base: Path) -> Path | None:
    text = check.string(raw, path)
    if text is None:
        if raw is None:
            check.error(path, "required for a directory source (a folder, relative to the config file)")
        return None
    folder = Path(os.path.normpath(base / Path(text).expanduser()))
    if not folder.exists():
        check.warn(path, f"folder {str(folder)!r} does not exist (yet); the source finds nothing until it does")
    elif not folder.is_dir():
        check.error(path, f"expected a folder, but {str(folder)!r} is a file")
    return folder

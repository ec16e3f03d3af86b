"""apiary.yaml: find it, read it, check every key, and build a frozen `Config`.

The loader never stops at the first problem: it walks the whole file, collects
every error (each naming the file, the key path such as `agents[1].runner`,
and what was expected) and raises one `ConfigError` carrying them all, so a
user fixes a file in one round trip. Problems that do not stop Apiary from
running (a source folder that does not exist yet, a heartbeat close to the
lease) become `Config.warnings`.

Order of work: YAML (duplicate keys rejected) → `${VAR}` interpolation over
every string value → one checker per section → cross-checks between sections.

Modules, in the order a file goes through them:

* `loading`  — find_config_path, load, the YAML loader, interpolation
* `sections` — the top level, agents, workflows (steps, retry, hooks), sources
* `settings` — `settings` and `settings.queue`, with their cross-checks
* `checker`  — `_Checker` (collects errors) and the per-value readers
* `schema`   — the frozen dataclasses and the keys each section accepts

Callers import from `workflows.config` only; the names below are the API.
"""

from .checker import parse_duration
from .loading import DEFAULT_CONFIG_NAME, ConfigError, find_config_path, load
from .schema import (
    AdminSettings,
    AgentConfig,
    Config,
    MetricsSettings,
    QueueSettings,
    Settings,
    SourceConfig,
    StepConfig,
    TlsSettings,
    WorkflowConfig,
    is_loopback,
    listen_host,
)

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "AdminSettings",
    "AgentConfig",
    "Config",
    "ConfigError",
    "MetricsSettings",
    "QueueSettings",
    "Settings",
    "SourceConfig",
    "StepConfig",
    "TlsSettings",
    "WorkflowConfig",
    "find_config_path",
    "is_loopback",
    "listen_host",
    "load",
    "parse_duration",
]

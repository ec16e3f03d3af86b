"""Queue settings in force: lease and heartbeat durations, limits, attempts.

They come from `settings.queue` of apiary.yaml (the config loader calls
`configure`); tests install their own with `configure` too. Services read
`current()` at call time, never a copy taken at import.
"""

import dataclasses
import datetime as dt
import functools

DIMENSIONS = ("project", "source", "agent", "runner", "pool")

# apiary.yaml names the keyed overrides in the plural (`agents: {deployer: 1}`).
PLURAL = {"project": "projects", "source": "sources", "agent": "agents", "runner": "runners", "pool": "pools"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """Concurrency limits per dimension: 0 or absent means unlimited; a keyed
    value overrides the dimension's default."""

    defaults: dict[str, int] = dataclasses.field(default_factory=dict)
    overrides: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def limit(self, dimension: str, key: str | None) -> int:
        if key is None or key == "":
            return 0
        keyed = self.overrides.get(dimension, {})
        if key in keyed:
            return keyed[key]
        return self.defaults.get(dimension, 0)

    def active_dimensions(self) -> tuple[str, ...]:
        """Dimensions where some key may be limited; the others cost the claim nothing.
        Worked out once per Limits (frozen; every claim and finish asks)."""
        return self._active

    @functools.cached_property
    def _active(self) -> tuple[str, ...]:
        return tuple(
            d for d in DIMENSIONS if self.defaults.get(d, 0) > 0 or any(v > 0 for v in self.overrides.get(d, {}).values())
        )


@dataclasses.dataclass(frozen=True)
class QueueConfig:
    lease_duration: float = 30.0
    heartbeat_interval: float = 10.0
    worker_timeout: float = 30.0
    max_attempts: int = 5
    limits: Limits = dataclasses.field(default_factory=Limits)
    # Worker identity and budgets (README "Security").
    enrollment: bool = True  # the shared worker token may enrol new worker ids
    claim_rate: float = 20.0  # claim calls per second per worker id, per listener process...
    claim_burst: int = 40  # ...after a burst of this many
    forget_workers_after: float = 86400.0  # silent this long and never held an attempt: forgotten

    @property
    def lease(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.lease_duration)


_current = QueueConfig()


def current() -> QueueConfig:
    return _current


def configure(config: QueueConfig) -> QueueConfig:
    """Install `config`; returns the previous one (tests restore it)."""
    global _current
    previous, _current = _current, config
    return previous

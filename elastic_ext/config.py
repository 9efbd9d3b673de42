"""ElasticConfig: every tunable of elastic_ext, validated once.

Precedence is argument > ``ELASTIC_EXT_*`` environment variable > default.
This is the only module that reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from elastic_ext.errors import ConfigError

ENV_PREFIX = "ELASTIC_EXT_"
ENV_ROLLBACK_LIMIT = "ELASTIC_EXT_ROLLBACK_LIMIT"
ENV_EVENTS_PATH = "ELASTIC_EXT_EVENTS_PATH"
ENV_VERIFY_SYNC = "ELASTIC_EXT_VERIFY_SYNC"
ENV_COMMIT_BUFFERS = "ELASTIC_EXT_COMMIT_BUFFERS"
ENV_LOG_COMMITS = "ELASTIC_EXT_LOG_COMMITS"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name} ({text!r}) must be one of {sorted(_TRUE | _FALSE)}")


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) must be an integer") from None


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Settings of the committed state and the ``run`` decorator.

    Attributes:
        rollback_limit: how many rollbacks in a row may happen without a new
            commit in between before the job ends with ``RollbackLimitError``.
        events_path: file that receives one JSON object per line for every
            recovery event; ``{rank}`` in the path is replaced by the rank at
            start-up. ``None`` logs events without writing a file.
        verify_sync: compare a checksum of the committed state across the
            ranks that hold the same commit id during ``sync()``; a mismatch
            raises ``StateDivergenceError``.
        commit_buffers: 1 keeps one host copy of the state and copies into it
            in place after validating every object (an interrupted copy marks
            the commit torn: it is never restored from); 2 copies into a spare
            buffer and swaps, so even an interrupted copy leaves the previous
            commit intact, at the price of a second host copy.
        log_commits: also write an event for every commit (chatty).

    Raises:
        ConfigError: a value is out of range or an environment variable does
            not parse; the message quotes the value.
    """

    rollback_limit: int = 5
    events_path: Optional[str] = None
    verify_sync: bool = True
    commit_buffers: int = 1
    log_commits: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rollback_limit, int) or self.rollback_limit < 0:
            raise ConfigError(f"rollback_limit ({self.rollback_limit!r}) must be an integer >= 0")
        if self.commit_buffers not in (1, 2):
            raise ConfigError(f"commit_buffers ({self.commit_buffers!r}) must be 1 or 2")
        if self.events_path is not None and not str(self.events_path).strip():
            raise ConfigError(f"events_path ({self.events_path!r}) must be a non-empty path or None")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "ElasticConfig":
        """Builds a config from arguments, then ``ELASTIC_EXT_*`` variables, then defaults."""
        env = os.environ if environ is None else environ
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown ElasticConfig fields {sorted(unknown)}; expected some of {sorted(known)}")
        values: dict = {}
        if ENV_ROLLBACK_LIMIT in env:
            values["rollback_limit"] = _parse_int(ENV_ROLLBACK_LIMIT, env[ENV_ROLLBACK_LIMIT])
        if env.get(ENV_EVENTS_PATH):
            values["events_path"] = env[ENV_EVENTS_PATH]
        if ENV_VERIFY_SYNC in env:
            values["verify_sync"] = _parse_bool(ENV_VERIFY_SYNC, env[ENV_VERIFY_SYNC])
        if ENV_COMMIT_BUFFERS in env:
            values["commit_buffers"] = _parse_int(ENV_COMMIT_BUFFERS, env[ENV_COMMIT_BUFFERS])
        if ENV_LOG_COMMITS in env:
            values["log_commits"] = _parse_bool(ENV_LOG_COMMITS, env[ENV_LOG_COMMITS])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

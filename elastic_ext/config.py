"""ElasticConfig: every tunable of elastic_ext, validated once.

Precedence is argument > ``ELASTIC_EXT_*`` environment variable > default.
This is the only module that reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from elastic_ext.errors import ConfigError

ENV_PREFIX = "ELASTIC_EXT_"
ENV_EVENTS_PATH = "ELASTIC_EXT_EVENTS_PATH"
ENV_CHECKPOINT_DIR = "ELASTIC_EXT_CHECKPOINT_DIR"
ENV_HOROVOD_GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# Read by the launcher and its workers' entry module, before any ElasticConfig (elastic_ext.launch.keeper).
ENV_RESTART_IN_PLACE = "ELASTIC_EXT_RESTART_IN_PLACE"
ENV_RESTARTED_IN_PLACE = "ELASTIC_EXT_RESTARTED_IN_PLACE"  # set by the keeper: 0 for its first child, k after k restarts
ENV_LAUNCHER = "ELASTIC_EXT_LAUNCHER"  # set by elastic-horovodrun for its workers: their entry module ran
# Set by horovodrun for every elastic worker: where its rendezvous server listens.
ENV_HOROVOD_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
ENV_HOROVOD_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"

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


def _parse_float(name: str, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) must be a number") from None


def _parse_path(name: str, text: str) -> str:
    return text


def _parse_every(name: str, text: str) -> Union[int, str]:
    """An integer, or "auto" (``checkpoint_every``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) must be an integer or 'auto'") from None


# How a variable's text becomes a field's value, by the type of the field's default (None: a path).
_PARSERS = {bool: _parse_bool, int: _parse_int, float: _parse_float, type(None): _parse_path}


def env_name(field: str) -> str:
    """The variable that sets ``ElasticConfig.<field>``: ``ELASTIC_EXT_`` and the field's name in capitals."""
    return ENV_PREFIX + field.upper()


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
        overlap_commit: run a commit's one collective (host updates, leaves,
            straggler table, commit-id check) in Horovod's background thread
            while training goes on, and read it at the next commit: no commit
            waits for a collective, and a resize, leave or eviction acts one
            commit later (a leave then needs two commits within
            ``term_grace_s``). Only PyTorch runs it in the background; other
            frameworks run it blocking, as without this option.
        prestart_newcomers: at a host addition, keep training while Horovod's
            driver starts the newcomers, and resize at the first commit
            after every newcomer has built its model and reached
            ``@elastic_ext.run`` (see :mod:`elastic_ext.launch.prestart`):
            survivors no longer stand idle while newcomers import the
            framework and build the model. On by default; it takes effect
            under ``elastic-horovodrun`` only, whose entry module starts a
            newcomer in a world of one (under plain ``horovodrun`` the job
            resets at once, as Horovod does). A newcomer that does not
            announce itself is waited for at most ``rendezvous_timeout_s``
            (120 s if that is 0) while the survivors train. Such a scale-up
            counts twice against ``horovodrun --reset-limit``.
        checkpoint_dir: directory (or fsspec URL) for durable checkpoints of
            the committed state, written in the background by rank 0 (see
            :mod:`elastic_ext.checkpoint`); a fresh job resumes from the
            newest valid one. ``None`` turns durable checkpoints off.
        checkpoint_every: write a checkpoint every this many commits (by
            commit id); ``"auto"``: as often as Young's rule says from the
            measured cost of a write and the failures the job has seen
            (:mod:`elastic_ext.checkpoint.cadence`).
        checkpoint_keep_last: keep the newest this many checkpoints.
        checkpoint_keep_every: also keep every checkpoint whose commit id is
            a multiple of this; 0 keeps no extra ones.
        checkpoint_wait_s: the longest a commit waits for the previous
            checkpoint write to finish when the next one is due; if it is
            still running then, this commit's checkpoint is skipped (logged)
            and the next commit is checkpointed instead.
        checkpoint_failure_limit: after this many checkpoint writes failed
            in a row (a full disk, lost storage credentials, a bad path),
            every rank stops at the next commit with ``CheckpointError``
            rather than train on for days with no checkpoint to resume
            from; a ``checkpoint_failing`` event says so first. Every failed
            write is retried at the next commit, so a brief storage outage
            of fewer writes than this costs nothing.
        checkpoint_nice: the niceness (0 to 19) of the background write's
            thread. The write needs about 0.55 s of CPU per GB (checksum,
            copy into the page cache); where every core trains, that time
            is lost to training whatever the priority. At 19 it is spread
            as a ~1 % slowdown over the many steps the write then takes
            (about 20 times longer on a busy node, so fewer checkpoints
            keep up) instead of a few steps slowed by half: steadier step
            times. A write started for a leave (``force``) runs at the
            training's own priority. 0 (the default) keeps that priority.
        heartbeat_period_s: how often the worker tells its guardian process
            that it is alive.
        hang_timeout_s: a worker whose heartbeat stops this long (SIGSTOP, a
            process frozen in native code) is SIGKILLed by its guardian, which
            turns a hang into an ordinary failure. 0 turns the guardian off.
        stall_timeout_s: a worker whose training makes no progress (no commit,
            no ``record_step``) for this long while it is *not* waiting in a
            Horovod collective is the one holding everybody up: it kills
            itself. Waiting ranks never fire, so a slow but healthy worker is
            never declared dead as long as one of its steps takes less than
            this. 0 turns it off. An open ``elastic_ext.phase(...)`` (evaluation,
            validation) and a suspension of the whole process (the heartbeat
            thread sees its own clock jump) are never counted as idle time.
        first_step_timeout_s: the stall limit before the first step of each
            training span completes (the first step compiles, warms caches,
            or waits for newcomers); 0 means no stall check until then.
        term_grace_s: after SIGTERM, how long a worker keeps training to reach
            the next commit and leave without a rollback; after that it exits.
        rendezvous_timeout_s: how long the ranks re-forming a job after a
            failure or resize wait for the others (newcomers start Python,
            import the framework and build the model first). ``run`` sets
            Horovod's ``HOROVOD_GLOO_TIMEOUT_SECONDS`` to it before each
            reset, and the launcher's entry module (from ``ELASTIC_EXT_*``
            variables) before a newcomer's first ``hvd.init()``, unless
            that variable was set already; Horovod's own 30 s
            killed every waiting rank (and the job) when a newcomer took
            longer. Gloo uses the same value as its collective timeout, the
            last resort for a peer that is alive but unreachable; failures
            and hangs are caught well before it. 0 leaves Horovod's value.

    Raises:
        ConfigError: a value is out of range or an environment variable does
            not parse; the message quotes the value.
    """

    rollback_limit: int = 5
    events_path: Optional[str] = None
    verify_sync: bool = True
    commit_buffers: int = 1
    overlap_commit: bool = False
    prestart_newcomers: bool = True
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Union[int, str] = dataclasses.field(default=1, metadata={"parse": _parse_every})
    checkpoint_keep_last: int = 3
    checkpoint_keep_every: int = 0
    checkpoint_wait_s: float = 0.0
    checkpoint_nice: int = 0
    checkpoint_failure_limit: int = 5
    heartbeat_period_s: float = 0.5
    hang_timeout_s: float = 10.0
    stall_timeout_s: float = 600.0
    term_grace_s: float = 30.0
    first_step_timeout_s: float = 1800.0
    rendezvous_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.rollback_limit, int) or self.rollback_limit < 0:
            raise ConfigError(f"rollback_limit ({self.rollback_limit!r}) must be an integer >= 0")
        if self.commit_buffers not in (1, 2):
            raise ConfigError(f"commit_buffers ({self.commit_buffers!r}) must be 1 or 2")
        if self.events_path is not None and not str(self.events_path).strip():
            raise ConfigError(f"events_path ({self.events_path!r}) must be a non-empty path or None")
        self._validate_checkpoint()
        self._validate_detection()

    def _validate_detection(self) -> None:
        for name in ("heartbeat_period_s", "hang_timeout_s", "stall_timeout_s", "term_grace_s",
                     "first_step_timeout_s", "rendezvous_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name} ({value!r}) must be a finite number >= 0")
        if self.heartbeat_period_s <= 0:
            raise ConfigError(f"heartbeat_period_s ({self.heartbeat_period_s!r}) must be > 0")
        if self.hang_timeout_s and self.hang_timeout_s < 4 * self.heartbeat_period_s:
            raise ConfigError(f"hang_timeout_s ({self.hang_timeout_s!r}) must be 0 (off) or at least 4 x "
                              f"heartbeat_period_s ({self.heartbeat_period_s!r}), or a busy machine looks hung")

    def _validate_checkpoint(self) -> None:
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str)
                                                or not self.checkpoint_dir.strip()):
            raise ConfigError(f"checkpoint_dir ({self.checkpoint_dir!r}) must be a non-empty path or None")
        every = self.checkpoint_every
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ConfigError(f"checkpoint_every ({every!r}) must be an integer >= 1 or 'auto'")
        for name, low in (("checkpoint_keep_last", 1), ("checkpoint_keep_every", 0),
                          ("checkpoint_failure_limit", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} ({value!r}) must be an integer >= {low}")
        wait = self.checkpoint_wait_s
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait < float("inf"):
            raise ConfigError(f"checkpoint_wait_s ({wait!r}) must be a finite number >= 0")
        nice = self.checkpoint_nice
        if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
            raise ConfigError(f"checkpoint_nice ({nice!r}) must be an integer from 0 to 19")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "ElasticConfig":
        """Builds a config from arguments, then ``ELASTIC_EXT_*`` variables (:func:`env_name`), then defaults."""
        env = os.environ if environ is None else environ
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown ElasticConfig fields {sorted(unknown)}; expected some of {sorted(known)}")
        values: dict = {}
        for field in dataclasses.fields(cls):
            name = env_name(field.name)
            text = env.get(name)
            if text is None or (field.default is None and not text.strip()):
                continue  # an empty path means "not set", as if the variable were absent
            values[field.name] = field.metadata.get("parse", _PARSERS.get(type(field.default)))(name, text)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def elastic_horovodrun(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in a worker that an elastic ``horovodrun`` (``--min-np``/``--max-np``, a discovery script) started."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_ELASTIC") == "1"


def launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in a worker that ``elastic-horovodrun`` started through its entry module
    (:mod:`elastic_ext.launch.worker`), which installs what must run before the user's code."""
    env = os.environ if environ is None else environ
    return env.get(ENV_LAUNCHER) == "1"


def restart_in_place(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``ELASTIC_EXT_RESTART_IN_PLACE`` (default off); raises ConfigError naming a bad value."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_RESTART_IN_PLACE, "")
    return bool(text.strip()) and _parse_bool(ENV_RESTART_IN_PLACE, text)


def horovod_rendezvous(environ: Optional[Mapping[str, str]] = None) -> Optional[tuple]:
    """(address, port) of horovodrun's rendezvous server, or None outside horovodrun."""
    env = os.environ if environ is None else environ
    addr, port = env.get(ENV_HOROVOD_RENDEZVOUS_ADDR), env.get(ENV_HOROVOD_RENDEZVOUS_PORT)
    if not addr or not port:
        return None
    return addr, _parse_int(ENV_HOROVOD_RENDEZVOUS_PORT, port)


# --- preemption notices (elastic_ext.launch.notices) ------------------------------------------------------------
# Which metadata service a worker watches for preemption notices, read by the launcher's entry module. Unset: the
# cloud is detected from the machine's DMI data (docs/preemption.md). "off"; a cloud ("aws", "gcp", "azure"); or
# "CLOUD=URL" to ask that cloud's documented paths under another base URL (IMDS over IPv6, the tests' local
# server, where "{host}" stands for the worker's host name); several, separated by commas, are all watched.
ENV_NOTICE_ENDPOINT = "ELASTIC_EXT_NOTICE_ENDPOINT"
NOTICE_CLOUDS = ("aws", "gcp", "azure")


def notice_endpoints(environ: Optional[Mapping[str, str]] = None) -> Optional[list]:
    """``ELASTIC_EXT_NOTICE_ENDPOINT`` as [(cloud, base URL or None), ...] ([] for "off"); None when unset.

    Raises:
        ConfigError: an entry names no known cloud, or its URL is not http(s).
    """
    env = os.environ if environ is None else environ
    text = env.get(ENV_NOTICE_ENDPOINT, "").strip()
    if not text:
        return None
    if text.lower() == "off":
        return []
    endpoints = []
    for item in text.split(","):
        cloud, sep, url = item.strip().partition("=")
        cloud, url = cloud.strip().lower(), url.strip()
        if cloud not in NOTICE_CLOUDS or (sep and not url.startswith(("http://", "https://"))):
            raise ConfigError(f"{ENV_NOTICE_ENDPOINT} ({text!r}): {item.strip()!r} must be one of "
                              f"{list(NOTICE_CLOUDS)} or CLOUD=URL with an http(s) URL, e.g. "
                              "'aws=http://[fd00:ec2::254]'; or the whole value 'off'")
        endpoints.append((cloud, url.rstrip("/") if sep else None))
    return endpoints

"""ElasticConfig: every tunable of elastic_ext, validated once.

Precedence is argument > ``ELASTIC_EXT_*`` environment variable > default.
Settings are parsed here only; which modules read the environment otherwise, and why, is
listed in ``docs/architecture.md``, "Who reads the environment".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

from elastic_ext.config_text import PARSERS as _PARSERS, parse_bool, parse_every, parse_int
from elastic_ext.errors import ConfigError

ENV_PREFIX = "ELASTIC_EXT_"
HEARTBEAT_PERIOD_S = 0.5            # how often a worker tells its guardian (and its stall check) that it runs
MIN_HANG_TIMEOUT_S = 4 * HEARTBEAT_PERIOD_S
MIN_GLOO_TIMEOUT_S = 1.0            # Gloo's timeouts are whole seconds: less was silently raised to 1 s
SSH_HOST_KEYS = {"accept-new": "accept-new", "strict": "yes"}  # setting -> ssh's StrictHostKeyChecking
ENV_EVENTS_PATH = "ELASTIC_EXT_EVENTS_PATH"
ENV_CHECKPOINT_DIR = "ELASTIC_EXT_CHECKPOINT_DIR"
ENV_HOROVOD_GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# Set by the launcher for its workers, read before any ElasticConfig exists (not settings):
# whether they restart in place (elastic_ext.worker.keeper), and horovodrun's --min-np.
ENV_RESTART_IN_PLACE = "ELASTIC_EXT_RESTART_IN_PLACE"
ENV_MIN_NP = "ELASTIC_EXT_MIN_NP"
ENV_RESTARTED_IN_PLACE = "ELASTIC_EXT_RESTARTED_IN_PLACE"  # set by the keeper: 0 for its first child, k after k restarts
ENV_LAUNCHER = "ELASTIC_EXT_LAUNCHER"  # set by elastic-horovodrun for its workers: their entry module ran
ENV_RESTART = "ELASTIC_EXT_RESTART"  # set by elastic_ext.launch.supervise: 0 for the first run, k after k restarts
# Set by horovodrun for every elastic worker: where its rendezvous server listens.
ENV_HOROVOD_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
ENV_HOROVOD_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
# Where workers ask for preemption notices (docs/preemption.md; unset: the cloud the firmware names).
ENV_NOTICE_ENDPOINT = "ELASTIC_EXT_NOTICE_ENDPOINT"
NOTICE_CLOUDS = ("aws", "gcp", "azure")
# Variables of this prefix that are not settings: the launcher's and the supervisor's to the workers,
# tools/setup.sh's cache, and the notices' endpoint (a test seam, and the rare machine whose endpoint is elsewhere).
NOT_SETTINGS = frozenset({ENV_RESTART_IN_PLACE, ENV_RESTARTED_IN_PLACE, ENV_LAUNCHER, ENV_MIN_NP, ENV_RESTART,
                          "ELASTIC_EXT_CACHE", ENV_NOTICE_ENDPOINT})



def env_name(field: str) -> str:
    """The variable that sets ``ElasticConfig.<field>``: ``ELASTIC_EXT_`` and the field's name in capitals."""
    return ENV_PREFIX + field.upper()


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Settings of the committed state and the ``run`` decorator.

    Attributes:
        rollback_limit: how many rollbacks in a row may happen without a new
            commit in between before the job ends with ``RollbackLimitError``;
            numeric rollbacks (the guard) are counted apart, against the same limit.
        events_path: file that receives one JSON object per line for every
            recovery event; ``{rank}`` in the path is replaced by the rank at
            start-up. ``None`` logs events without writing a file.
        commit_buffers: 1 keeps one host copy of the state and copies into it
            in place after validating every object (an interrupted copy marks
            the commit torn: it is never restored from); 2 copies into a spare
            buffer and swaps, so even an interrupted copy leaves the previous
            commit intact, at the price of a second host copy.
        checkpoint_dir: directory (or fsspec URL) for durable checkpoints of
            the committed state, written in the background by rank 0 (see
            :mod:`elastic_ext.checkpoint`); a fresh job resumes from the
            newest valid one. ``None`` turns durable checkpoints off.
        checkpoint_every: write a checkpoint every this many commits (by
            commit id); ``"auto"``: as often as Young's rule says from the
            measured cost of a write and the failures the job has seen
            (:mod:`elastic_ext.checkpoint.cadence`).
        checkpoint_keep_last: keep the newest this many checkpoints that verify.
        checkpoint_fresh_start: start from the initial state even if the directory's checkpoints cannot be used
            (all corrupt, or of a newer format version); off, the job stops with ``CheckpointError`` instead of
            training again and overwriting them.
        checkpoint_failure_limit: after this many checkpoint writes failed
            in a row (a full disk, lost storage credentials, a bad path),
            every rank stops at the next commit with ``CheckpointError``
            rather than train on for days with no checkpoint to resume
            from; a ``checkpoint_failing`` event says so first. Every failed
            write is retried at the next commit, so a brief storage outage
            of fewer writes than this costs nothing.
        replica_check_every: every this many commits (by commit id), each
            rank's digest of what must agree across ranks rides on the
            commit's collective; ranks whose committed state differs from a
            strict majority's (silent data corruption) take the majority's,
            and a host wrong twice within a day leaves (see
            :mod:`elastic_ext.policies.replica_check`). With no strict majority (two
            ranks, a tie) the job stops with ``StateDivergenceError``. 0
            turns it off.
        exclude_file: a file of host names that the discovery script keeps
            out of the job (``host_discovery/static.py --exclude-file``); a
            rank evicted as a straggler or whose host committed a corrupt
            replica twice appends its host. None: no file.
        hang_timeout_s: a worker that sent its guardian process no heartbeat
            for this long *and* ran for less than 2 % of that time on
            the CPU (stopped by SIGSTOP, blocked in the kernel, deadlocked in
            native code) is SIGKILLed by its guardian, which turns a hang
            into an ordinary failure. A C call that holds the GIL and
            computes for an hour keeps the CPU busy: not a hang. 0 turns the
            guardian off.
        stall_timeout_s: a worker whose main thread, for this long, neither
            made progress (commit, ``record_step``, :func:`elastic_ext.progress`),
            nor waited in a Horovod collective, nor had a
            :func:`elastic_ext.phase` open, nor moved (its innermost frame
            stayed where it was) nor ran on the CPU is the one holding
            everybody up (a deadlock, a read that never returns): it kills
            itself. An evaluation of an hour outside ``phase()`` moves and
            computes, a compilation computes: neither is a stall. A
            suspension of the whole process (the heartbeat thread sees its
            own clock jump) is not idle time. 0 turns it off.
        term_grace_s: after SIGTERM, how long a worker keeps training to reach
            the next commit and leave without a rollback; after that it exits.
        rendezvous_timeout_s: how long workers wait for peers that are still
            starting (Python, the framework, the model): the survivors of an
            early start wait this long for its newcomers to announce
            themselves (while they train), and an ``hvd.init()`` that may
            meet freshly started workers (the job's first; every reset under
            plain ``horovodrun``; one that must refill the job to
            ``--min-np``) uses it as Gloo's timeout. Horovod's own 30 s
            killed every waiting rank when a newcomer took longer. 0 leaves
            Horovod's value.
        collective_timeout_s: Gloo's timeout for the resets under
            ``elastic-horovodrun`` whose round holds only running workers
            (every reset but one that must refill the job to ``--min-np``):
            how long a collective waits for a peer that does not answer. A
            healthy peer's Horovod thread answers every few milliseconds,
            also while its training evaluates or computes for an hour, so
            only a peer that is gone or unreachable (a network partition)
            ever reaches it; it then costs this long instead of
            ``rendezvous_timeout_s``. Until the job's first reset, Gloo uses
            ``rendezvous_timeout_s``. 0 leaves Horovod's value.
        ssh_host_keys: how the launcher's ssh to worker hosts checks their host keys: ``accept-new`` (a new host's
            key is learnt, a changed key refuses the connection) or ``strict`` (only keys already in known_hosts).

    Raises:
        ConfigError: a value is out of range or an environment variable does
            not parse; the message quotes the value.
    """

    rollback_limit: int = 5
    events_path: Optional[str] = None
    commit_buffers: int = 1
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Union[int, str] = dataclasses.field(default="auto", metadata={"parse": parse_every})
    checkpoint_keep_last: int = 3
    checkpoint_fresh_start: bool = False
    checkpoint_failure_limit: int = 5
    replica_check_every: int = 10
    exclude_file: Optional[str] = None
    hang_timeout_s: float = 10.0
    stall_timeout_s: float = 600.0
    term_grace_s: float = 30.0
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 30.0
    ssh_host_keys: str = dataclasses.field(default="accept-new", metadata={"parse": lambda name, text: text})

    def __post_init__(self) -> None:
        if not isinstance(self.rollback_limit, int) or self.rollback_limit < 0:
            raise ConfigError(f"rollback_limit ({self.rollback_limit!r}) must be an integer >= 0")
        if self.commit_buffers not in (1, 2):
            raise ConfigError(f"commit_buffers ({self.commit_buffers!r}) must be 1 or 2")
        if self.events_path is not None and not str(self.events_path).strip():
            raise ConfigError(f"events_path ({self.events_path!r}) must be a non-empty path or None")
        self._validate_checkpoint()
        every = self.replica_check_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ConfigError(f"replica_check_every ({every!r}) must be an integer >= 0 (0: off)")
        if self.exclude_file is not None and (not isinstance(self.exclude_file, str) or not self.exclude_file.strip()):
            raise ConfigError(f"exclude_file ({self.exclude_file!r}) must be a non-empty path or None")
        if self.ssh_host_keys not in SSH_HOST_KEYS:
            raise ConfigError(f"ssh_host_keys ({self.ssh_host_keys!r}) must be one of {sorted(SSH_HOST_KEYS)}")
        self._validate_detection()

    def _validate_detection(self) -> None:
        for name in ("hang_timeout_s", "stall_timeout_s", "term_grace_s", "rendezvous_timeout_s",
                     "collective_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name} ({value!r}) must be a finite number >= 0")
            if name in ("rendezvous_timeout_s", "collective_timeout_s") and 0 < value < MIN_GLOO_TIMEOUT_S:
                raise ConfigError(f"{name} ({value!r}) must be 0 (Horovod's value) or at least {MIN_GLOO_TIMEOUT_S}"
                                  " (Gloo counts whole seconds)")
        if self.hang_timeout_s and self.hang_timeout_s < MIN_HANG_TIMEOUT_S:
            raise ConfigError(f"hang_timeout_s ({self.hang_timeout_s!r}) must be 0 (off) or at least "
                              f"{MIN_HANG_TIMEOUT_S} (4 heartbeats), or a busy machine looks hung")

    def _validate_checkpoint(self) -> None:
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str)
                                                or not self.checkpoint_dir.strip()):
            raise ConfigError(f"checkpoint_dir ({self.checkpoint_dir!r}) must be a non-empty path or None")
        every = self.checkpoint_every
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ConfigError(f"checkpoint_every ({every!r}) must be an integer >= 1 or 'auto'")
        if not isinstance(self.checkpoint_fresh_start, bool):
            raise ConfigError(f"checkpoint_fresh_start ({self.checkpoint_fresh_start!r}) must be True or False")
        for name, low in (("checkpoint_keep_last", 1), ("checkpoint_failure_limit", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} ({value!r}) must be an integer >= {low}")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "ElasticConfig":
        """Builds a config from arguments, then ``ELASTIC_EXT_*`` variables (:func:`env_name`), then defaults."""
        env = os.environ if environ is None else environ
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"unknown ElasticConfig fields {sorted(unknown)}; expected some of {sorted(known)}")
        stray = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in NOT_SETTINGS
                       and name[len(ENV_PREFIX):].lower() not in known)
        if stray:  # a removed setting, or a typo: it would change nothing, silently
            raise ConfigError(f"{stray[0]} is not a setting (ElasticConfig has {sorted(map(env_name, known))}); "
                              "unset it")
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
    (:mod:`elastic_ext.worker.entry`), which installs what must run before the user's code."""
    env = os.environ if environ is None else environ
    return env.get(ENV_LAUNCHER) == "1"


def restart_in_place(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``ELASTIC_EXT_RESTART_IN_PLACE``, which the launcher sets (default off); raises ConfigError naming a bad value."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_RESTART_IN_PLACE, "")
    return bool(text.strip()) and parse_bool(ENV_RESTART_IN_PLACE, text)


def horovod_rendezvous(environ: Optional[Mapping[str, str]] = None) -> Optional[tuple]:
    """(address, port) of horovodrun's rendezvous server, or None outside horovodrun."""
    env = os.environ if environ is None else environ
    addr, port = env.get(ENV_HOROVOD_RENDEZVOUS_ADDR), env.get(ENV_HOROVOD_RENDEZVOUS_PORT)
    return (addr, parse_int(ENV_HOROVOD_RENDEZVOUS_PORT, port)) if addr and port else None


def launch_min_np(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``horovodrun --min-np`` of the job, as the launcher passes it to its workers; None if unknown."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_MIN_NP, "").strip()
    return parse_int(ENV_MIN_NP, text) if text else None


def notice_endpoints(environ: Optional[Mapping[str, str]] = None) -> Optional[list]:
    """``ELASTIC_EXT_NOTICE_ENDPOINT`` ("off", or CLOUD or CLOUD=URL, comma-separated) as [(cloud, base URL or
    None), ...] ([] for "off"); None when unset. Raises ConfigError naming an unknown cloud or a non-http(s) URL."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_NOTICE_ENDPOINT, "").strip()
    if not text or text.lower() == "off":
        return [] if text else None
    endpoints = []
    for item in text.split(","):
        cloud, sep, url = (part.strip() for part in item.partition("="))
        if cloud.lower() not in NOTICE_CLOUDS or (sep and not url.startswith(("http://", "https://"))):
            raise ConfigError(f"{ENV_NOTICE_ENDPOINT} ({text!r}): {item.strip()!r} must be one of "
                              f"{list(NOTICE_CLOUDS)} or CLOUD=URL, URL http(s), e.g. 'aws=http://[fd00:ec2::254]'")
        endpoints.append((cloud.lower(), url.rstrip("/") if sep else None))
    return endpoints

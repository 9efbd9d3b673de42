"""Declared fault injection: faults, their schedule, a commit probe, resizes, bit flips.

:class:`FaultSchedule` declares injected faults up front: which rank (or
pid-stable slot) dies, at which step, and how (SIGKILL, SIGSTOP, SIGTERM,
exception, or the end the closed-links watch gives a worker whose peers
failed), or which array it corrupts with a flipped bit (silent data
corruption, :func:`flip_bit`); each fires once, recorded in a marker file so
that a restarted worker does not fire it again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from elastic_ext.errors import ConfigError


HOW = ("kill", "stop", "term", "exit", "raise", "hang", "flip", "peers_failed")
WHERE = ("step", "allreduce", "commit", "before_commit")
#: The bit a "flip" fault flips in the first element of its target: a low mantissa bit of a
#: float32, so the value stays finite and close (nothing but a digest can tell).
FLIP_BIT = 3


# The exit status of an injected "exit" fault: non-zero so Horovod's driver
# records a failure, and distinct from signals (128+n), Python errors (1) and
# the leave code (143), so a test can tell the injected exit from a crash.
FAULT_EXIT_CODE = 17

@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: on ``rank`` at ``step``, at point ``where``, do ``how``.

    ``where`` names the point in a step that the training script reaches:
    ``step`` (before the forward pass), ``allreduce`` (a collective is in
    flight), ``commit`` (in the middle of copying the state) or
    ``before_commit`` (after the step's update, before the commit that
    follows it). ``target`` names what a ``flip`` corrupts (the script maps
    names to arrays, e.g. ``param`` or ``moment``).
    """

    rank: int
    step: int
    how: str = "kill"
    where: str = "step"
    target: str = ""

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ConfigError(f"fault how ({self.how!r}) must be one of {HOW}")
        if self.where not in WHERE:
            raise ConfigError(f"fault where ({self.where!r}) must be one of {WHERE}")
        if (self.how == "flip") != bool(self.target):
            raise ConfigError(f"fault {self.how!r} with target {self.target!r}: a flip needs a target, "
                              "and only a flip takes one")


def flip_bit(array: np.ndarray, index: int = 0, bit: int = FLIP_BIT) -> None:
    """Flips bit ``bit`` of element ``index`` (in C order) of ``array`` in place.

    ``array`` must share memory with what it stands for (``tensor.numpy()``
    of a CPU tensor does).

    Raises:
        ValueError: ``array`` is not contiguous, or ``index``/``bit`` is out of range.
    """
    if not array.flags.c_contiguous:
        raise ValueError("flip_bit needs a contiguous array (a reshape would copy it)")
    flat = array.reshape(-1)
    if not 0 <= index < flat.size or not 0 <= bit < 8 * array.itemsize:
        raise ValueError(f"element {index} bit {bit} is outside an array of {flat.size} x {array.itemsize} bytes")
    raw = flat[index:index + 1].view(np.dtype(f"u{array.itemsize}"))
    raw ^= raw.dtype.type(1 << bit)


class FaultSchedule:
    """Faults declared up front; each fires at most once per job.

    Args:
        faults: the faults.
        marker_dir: directory where a fired fault leaves a marker file, so a
            replayed step (after rollback) or a new process does not fire it
            again.
    """

    def __init__(self, faults: List[Fault], marker_dir: str) -> None:
        self.faults = list(faults)
        self.marker_dir = marker_dir
        os.makedirs(marker_dir, exist_ok=True)

    @classmethod
    def parse(cls, text: str, marker_dir: str) -> "FaultSchedule":
        """Parses ``"RANK:STEP[:HOW[:WHERE[:TARGET]]],..."`` (HOW defaults to kill, WHERE to step)."""
        faults = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            fields = item.split(":")
            if len(fields) not in (2, 3, 4, 5):
                raise ConfigError(f"fault {item!r} must look like RANK:STEP[:HOW[:WHERE[:TARGET]]]")
            try:
                rank, step = int(fields[0]), int(fields[1])
            except ValueError:
                raise ConfigError(f"fault {item!r}: rank and step must be integers") from None
            faults.append(Fault(rank, step, *fields[2:]))
        return cls(faults, marker_dir)

    def fired(self) -> List[dict]:
        """What fired so far (pid, time, rank, step, how, where), from the marker files."""
        found = []
        for fault in self.faults:
            if os.path.exists(self._marker(fault)):
                with open(self._marker(fault), encoding="utf-8") as handle:
                    found.append(json.load(handle))
        return found

    def _marker(self, fault: Fault) -> str:
        target = f"-{fault.target}" if fault.target else ""
        return os.path.join(self.marker_dir, f"fault-{fault.rank}-{fault.step}-{fault.how}-{fault.where}{target}")

    def due(self, rank: int, step: int, where: str = "step") -> Optional[Fault]:
        for fault in self.faults:
            if (fault.rank, fault.step, fault.where) == (rank, step, where) and \
                    not os.path.exists(self._marker(fault)):
                return fault
        return None

    def maybe_fire(self, rank: int, step: int, where: str = "step",
                   targets: Optional[Dict[str, np.ndarray]] = None) -> None:
        """Fires the fault declared for (rank, step, where), once; a flip corrupts ``targets[fault.target]``.

        Raises:
            ConfigError: a flip's target is not among ``targets``.
        """
        fault = self.due(rank, step, where)
        if fault is None:
            return
        if fault.how == "flip" and fault.target not in (targets or {}):
            raise ConfigError(f"flip target {fault.target!r} must be one of {sorted(targets or {})}")
        with open(self._marker(fault), "w", encoding="utf-8") as handle:
            json.dump({"pid": os.getpid(), "time": time.time(), **dataclasses.asdict(fault)}, handle)
        if fault.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.how == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.how == "hang":
            while True:  # a step that never ends (the process stays responsive)
                time.sleep(0.01)
        elif fault.how == "exit":
            os._exit(FAULT_EXIT_CODE)
        elif fault.how == "peers_failed":
            from elastic_ext.runtime.closed_links import end_worker
            end_worker()
        elif fault.how == "flip":
            flip_bit(targets[fault.target])
        else:
            raise RuntimeError(f"injected fault at rank {rank} step {step}")


class CommitFaultProbe:
    """A state entry (and its own adapter) whose copy fires the fault declared
    for WHERE=commit: the process dies in the middle of ``commit()``.

    Put it in the state as ``State(..., commit_probe=probe, adapters=[probe])``
    and set ``probe.step`` to the step being committed just before each
    ``commit()`` (None outside). Its committed value is that step.
    """

    name, synced = "commit_fault_probe", True

    def __init__(self, faults: FaultSchedule, rank_fn) -> None:
        self.faults = faults
        self.rank_fn = rank_fn
        self.step: Optional[int] = None

    def handles(self, obj) -> bool:
        return obj is self

    def capture(self, obj):
        from elastic_ext.state.snapshot import Capture
        probe = self

        class Source:
            shape, dtype = (1,), np.dtype(np.int64)

            def copy_into(self, buffer: np.ndarray) -> None:
                if probe.step is not None:
                    probe.faults.maybe_fire(probe.rank_fn(), probe.step, where="commit")
                buffer[0] = probe.step or 0

        return Capture(arrays={"probe": Source()}, meta=None)

    def apply(self, obj, entry):
        return obj


def announce_hosts(state, path: str, hosts: Sequence[str], marker: str, wait_s: float) -> bool:
    """Rank 0, the coordinator (the only worker Horovod's driver tells of a host change): replaces the
    discovery host file ``path`` with ``hosts`` (``HOST:SLOTS`` lines, :func:`devkit.launch.write_hosts`),
    leaves ``marker`` so that it happens once, then waits until the driver has announced the change
    (``state.host_update_pending()``), at most ``wait_s``: True if it did. The commit that follows then
    resizes the job."""
    from devkit.launch import write_hosts  # (not at import: the workers that import this module need none of it)
    write_hosts(path, hosts)
    open(marker, "w").close()
    deadline = time.time() + wait_s
    while not state.host_update_pending():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


class HostFileSchedule:
    """Deterministic resizes for tests: rewrite a discovery host file at given steps.

    Spec: ``"STEP:HOSTFILE:HOST,HOST;STEP:HOSTFILE:HOST,..."``. At a listed
    step (at a commit), rank 0 rewrites the file, then waits until Horovod's
    driver has announced the change, so that the commit that follows resizes
    the job at exactly that step. Each entry applies once (a marker file).
    """

    def __init__(self, spec: str, wait_s: float = 60.0) -> None:
        self.entries = []
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            fields = item.split(":", 2)
            if len(fields) != 3:
                raise ConfigError(f"resize {item!r} must look like STEP:HOSTFILE:HOST[,HOST...]")
            try:
                step = int(fields[0])
            except ValueError:
                raise ConfigError(f"resize {item!r}: step must be an integer") from None
            self.entries.append((step, fields[1], fields[2].split(",")))
        self.wait_s = wait_s

    def maybe_apply(self, state, rank: int, step: int) -> None:
        """Called by every rank before a commit; only rank 0 acts."""
        if rank != 0:
            return
        for index, (at, path, hosts) in enumerate(self.entries):
            marker = f"{path}.done{index}"
            if at != step or os.path.exists(marker):
                continue
            announce_hosts(state, path, hosts, marker, self.wait_s)

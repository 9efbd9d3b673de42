"""One worker's liveness record: progress, open phases, in training or not, asked to leave or not.

The commit marks progress and carries the leaving flag in its collective
(:mod:`elastic_ext.state.host_updates`); the stall check
(:mod:`elastic_ext.runtime.watchdog`) and the SIGTERM handler
(:mod:`elastic_ext.worker.sigterm`) read and write it. One process-wide
instance, :data:`LIVENESS`, serves the public :func:`progress` and
:func:`phase`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, ContextManager, Dict, Iterator, List, Optional


class Liveness:
    """What the stall check and the SIGTERM handler know about one worker's training.

    Progress (commit, ``record_step``, :meth:`progress`), open phases,
    whether training runs now (inside ``@elastic_ext.run``'s function), and
    whether the worker was asked to leave. One process-wide instance,
    :data:`LIVENESS`, serves the public :func:`progress` and :func:`phase`;
    :class:`~elastic_ext.State`, ``run`` and :class:`Watchdog` are handed it.
    """

    def __init__(self) -> None:
        self.last_progress = time.monotonic()
        self._phases: List[str] = []
        self._phases_lock = threading.Lock()
        self._leaving = threading.Event()
        self._in_training = threading.Event()
        self._leave_deadline: Optional[float] = None
        self.leave_cause = "sigterm"
        self.leave_notice: Optional[Dict[str, Any]] = None  # the preemption notice that asked, for the event

    def progress(self) -> None:
        """Marks that training moved forward."""
        self.last_progress = time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Opens a long phase in which the stall check does not fire (see :func:`phase`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name ({name!r}) must be a non-empty string")
        with self._phases_lock:
            self._phases.append(name)
        self.progress()
        try:
            yield
        finally:
            with self._phases_lock:
                # Remove this phase (the newest with that name): phases nest.
                for i in range(len(self._phases) - 1, -1, -1):
                    if self._phases[i] == name:
                        del self._phases[i]
                        break
            self.progress()

    def open_phases(self) -> List[str]:
        """The phases open now, outermost first."""
        with self._phases_lock:
            return list(self._phases)

    @property
    def in_training(self) -> bool:
        """True inside ``@elastic_ext.run``'s training function."""
        return self._in_training.is_set()

    @contextmanager
    def training(self) -> Iterator[None]:
        """The span in which SIGTERM means "leave" and the stall check applies."""
        self.progress()
        self._in_training.set()
        try:
            yield
        finally:
            self._in_training.clear()

    def leaving(self) -> bool:
        """True once this worker was asked to leave (SIGTERM) and has not left yet."""
        return self._leaving.is_set()

    def ask_to_leave(self, grace_s: float, cause: str = "sigterm", notice: Optional[Dict[str, Any]] = None) -> None:
        """Records a request to leave at the next commit, within ``grace_s`` (``cause`` and ``notice``: for the event)."""
        self._leave_deadline = time.monotonic() + grace_s
        self.leave_cause = cause
        self.leave_notice = notice
        self._leaving.set()

    def leave_time_left(self) -> Optional[float]:
        """Seconds left of the grace period since the request to leave, or None without one."""
        if self._leave_deadline is None:
            return None
        return max(0.0, self._leave_deadline - time.monotonic())


LIVENESS = Liveness()  # this process's, behind the public progress() and phase()


def progress() -> None:
    """Marks that training moved forward (called by commit and ``record_step``).

    Call it from a long loop of your own (e.g. every evaluation batch) so
    that the stall check sees a healthy worker.
    """
    LIVENESS.progress()


def phase(name: str) -> ContextManager[None]:
    """Opens a long phase in which the stall check does not fire.

    ``with elastic_ext.phase("eval"): evaluate()`` (or ``state.phase``): an
    evaluation pass, a rank-0-only validation or a user checkpoint may take
    longer than ``stall_timeout_s``. The guardian still kills a worker that
    stops beating (SIGSTOP, frozen with the GIL held), and peers waiting in
    a collective are unaffected. Phases nest; leaving one counts as progress.
    """
    return LIVENESS.phase(name)


def open_phases() -> List[str]:
    """The phases open now in this process, outermost first."""
    return LIVENESS.open_phases()

"""Whether a worker's main thread is doing anything: where it is, and how much CPU it used.

The stall check (:mod:`elastic_ext.runtime.watchdog`) and the guardian
(:mod:`elastic_ext.runtime.guardian`) must tell a worker that is stuck (a
deadlock, a process stopped by SIGSTOP, a read that never returns) from one
that is only busy for a long time: an evaluation of an hour outside
``elastic_ext.phase()``, a C call that holds the GIL while it computes for a
minute, a compilation. A busy main thread moves (its innermost frame
changes) or runs on the CPU; a stuck one does neither. CPU time is read from
``/proc`` (Linux); elsewhere only the position is known.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional, Tuple

# A main thread that ran on the CPU for at least this fraction of a window was busy in it. Low on
# purpose: a stuck thread (stopped, blocked, deadlocked) uses none at all, and a busy one may get
# only a sliver of a core on a loaded machine.
BUSY_FRACTION = 0.02
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_s(pid: int, tid: int) -> Optional[float]:
    """CPU seconds (user + system) thread ``tid`` of process ``pid`` has used; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces:
    # state is the first, utime the 12th, stime the 13th.
    fields = text[text.rindex(b")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    except (IndexError, ValueError):
        return None


def busy(cpu_before: Optional[float], cpu_now: Optional[float], window_s: float) -> bool:
    """True when the CPU time used over ``window_s`` (two readings of :func:`thread_cpu_s`) shows work."""
    if cpu_before is None or cpu_now is None or window_s <= 0:
        return False
    used = cpu_now - cpu_before
    return used > 0 and used >= BUSY_FRACTION * window_s


class MainThread:
    """Samples this process's main thread: :meth:`moved` says whether it did anything since the last sample."""

    def __init__(self) -> None:
        main = threading.main_thread()
        self._ident, self._tid = main.ident, getattr(main, "native_id", None)
        self._position: Optional[Tuple[int, int, int]] = None
        self._cpu: Optional[float] = None
        self._at: Optional[float] = None

    def _where(self) -> Optional[Tuple[int, int, int]]:
        frame = sys._current_frames().get(self._ident)
        if frame is None:
            return None
        return id(frame), id(frame.f_code), frame.f_lasti

    def moved(self, now: float) -> bool:
        """True if the main thread's innermost frame changed, or it was busy on the CPU, since the last call."""
        position = self._where()
        cpu = thread_cpu_s(os.getpid(), self._tid) if self._tid is not None else None
        moved = (self._at is not None
                 and (position != self._position or busy(self._cpu, cpu, now - self._at)))
        self._position, self._cpu, self._at = position, cpu, now
        return moved

"""Process helpers for test daemons: die with the test process, stop by PID.

pytest-timeout's ``thread`` method ends a timed-out run with ``os._exit``,
which skips fixture teardown and atexit handlers. Daemons we start therefore
also get ``PR_SET_PDEATHSIG`` = SIGKILL, so the kernel kills them when the
pytest process goes away, however it goes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Callable, List

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """``preexec_fn`` for Popen: SIGKILL this child when its parent dies."""
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def alive(pid: int) -> bool:
    """True while ``pid`` runs; reaps it first if it is our exited child."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child (e.g. a daemon that forked away from us)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def terminate(pids: List[int], timeout_s: float) -> None:
    """SIGTERM every PID, then SIGKILL those still alive after ``timeout_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()

"""Time bounds for discovery: one overall deadline, and bounded external commands.

Horovod runs the discovery script with no timeout while holding its host
lock, so a hung script stalls every reset. Every scheduler or cloud call
therefore takes its timeout from :class:`Deadline`, which never hands out
more than what is left of the script's overall bound.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from elastic_ext.errors import DiscoveryInputError, DiscoveryTimeoutError, DiscoveryUnavailableError

logger = logging.getLogger(__name__)

# Below this a call cannot do useful work; fail fast instead of starting it.
MIN_CALL_TIMEOUT_S = 0.05
# How long a killed command may take to exit before we stop waiting for it.
KILL_GRACE_S = 1.0
# Longest stderr excerpt quoted in an error message.
MAX_QUOTED_STDERR = 500


class Deadline:
    """A point in (monotonic) time after which discovery must have answered.

    Args:
        timeout_s: seconds from now.
        clock: the time source (tests pass their own to reach a given
            remaining time without waiting for it).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise DiscoveryInputError(f"timeout_s ({timeout_s!r}) must be > 0")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._end = clock() + self.timeout_s

    def remaining_s(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._end - self._clock())

    def call_timeout_s(self, cap_s: float | None, what: str) -> float:
        """The timeout for one call: ``cap_s`` or what is left, whichever is smaller.

        Raises:
            DiscoveryTimeoutError: less than ``MIN_CALL_TIMEOUT_S`` is left.
        """
        left = self.remaining_s()
        if left < MIN_CALL_TIMEOUT_S:
            raise DiscoveryTimeoutError(
                f"no time left for {what}: the overall bound of {self.timeout_s:g} s is spent")
        return left if cap_s is None else min(cap_s, left)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_QUOTED_STDERR else text[:MAX_QUOTED_STDERR] + "..."


def run_command(argv: Sequence[str], timeout_s: float,
                env: Mapping[str, str] | None = None,
                check: bool = True) -> "subprocess.CompletedProcess[str]":
    """Run ``argv`` with a hard timeout and return its exit status and output.

    The command runs in its own process group, so on timeout the whole group
    (the command and anything it started) is killed.

    Raises:
        DiscoveryUnavailableError: the command is missing, or (with ``check``)
            exits non-zero; its stderr is quoted.
        DiscoveryTimeoutError: it did not finish within ``timeout_s``.
    """
    import subprocess  # here, not at the top: the static discovery, run every second, runs no command
    logger.debug("running %s (timeout %.2f s)", " ".join(argv), timeout_s)
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env=None if env is None else dict(env))
    except FileNotFoundError as exc:
        raise DiscoveryUnavailableError(f"command {argv[0]!r} not found: {exc}") from exc
    except OSError as exc:
        raise DiscoveryUnavailableError(f"cannot run {argv[0]!r}: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc)
        raise DiscoveryTimeoutError(
            f"{' '.join(argv)!r} did not answer within {timeout_s:.2f} s and was killed") from exc
    if check and proc.returncode != 0:
        raise DiscoveryUnavailableError(command_failure(argv, proc.returncode, err))
    if err.strip():
        logger.debug("%s wrote to stderr: %s", argv[0], _excerpt(err))
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def command_failure(argv: Sequence[str], returncode: int, stderr: str) -> str:
    """The message for a command that exited with ``returncode``."""
    return (f"{' '.join(argv)!r} exited with status {returncode}: "
            f"{_excerpt(stderr) or 'no stderr'}")


def _kill_group(proc: "subprocess.Popen[str]") -> None:
    import subprocess
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it exited between the timeout and the kill
    try:
        proc.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not exit %.1f s after SIGKILL", proc.pid, KILL_GRACE_S)


__all__ = ["Deadline", "run_command", "command_failure"]

"""The guardian: a sidecar that SIGKILLs its worker when the heartbeat stops.

Run as ``python -m elastic_ext.runtime.guardian --pid PID --timeout-s T`` with the
worker's heartbeat pipe on stdin (see :mod:`elastic_ext.runtime.watchdog`). Exits
quietly on EOF (the worker stopped the watchdog, or died) and when its parent
is gone.

Two rules keep it from killing the wrong process or a healthy one:

- **Only its own parent.** ``PID`` must be the guardian's parent (the worker
  starts it). A bare pid can be reused once the worker is gone (a DataLoader
  child that inherited the pipe keeps it open, so no EOF arrives): the
  guardian holds a pidfd of its parent (Linux >= 5.3) and signals through
  it, which can never reach another process, and also checks
  ``os.getppid() == PID`` before acting (the only check where pidfds do not
  exist). When the parent is gone the guardian leaves.
- **A busy worker is not a hang.** A C call that holds the GIL (a long
  parse, a library without GIL releases) keeps the heartbeat thread from
  running, but its main thread runs on the CPU. When the heartbeat has been
  silent for the timeout, the guardian kills only if the worker's main
  thread used the CPU for less than 2 % of that time
  (:mod:`elastic_ext.runtime.activity`): it is stopped, blocked or
  deadlocked. Otherwise it says so once and waits another timeout.
- **A suspension is not a hang.** When the whole job is stopped and
  continued (Slurm suspend, gang scheduling, a cgroup freezer) the guardian
  is frozen too; on waking it sees its own poll loop jump far past its period
  and restarts the timeout instead of killing a worker that never had a
  chance to beat.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from typing import Callable, Optional

from elastic_ext.runtime.activity import busy, thread_cpu_s

# A tick that comes this much later than asked (and at least JUMP_MIN_S) means
# the guardian itself did not run: it was suspended along with its worker.
JUMP_FACTOR = 3.0
JUMP_MIN_S = 2.0


def _parent_killer(pid: int) -> Optional[Callable[[], bool]]:
    """A function that SIGKILLs ``pid`` only while it is still this process's parent.

    Returns None when ``pid`` is not the parent now (nothing may ever be killed).
    The function returns True if the signal was sent.
    """
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
    # Checked after opening the pidfd: if pid is our parent now, the pidfd refers to it.
    if os.getppid() != pid:
        if pidfd is not None:
            os.close(pidfd)
        return None

    def kill() -> bool:
        if os.getppid() != pid:  # reparented: the worker is gone, the pid may belong to anyone
            return False
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    return kill


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    # Ignore SIGINT (a terminal's Ctrl-C reaches the worker's whole group): the guardian leaves when its
    # pipe closes, i.e. when the worker is gone. SIGTERM is not ignored: it ends the guardian (the default
    # action), and the worker, in the same group, got it too (worker/sigterm.py: leave, bounded by term_grace_s).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kill = _parent_killer(args.pid)
    if kill is None:
        sys.stderr.write(f"elastic_ext guardian: --pid {args.pid} is not this guardian's parent "
                         f"(parent is {os.getppid()}); a guardian only ever kills its own parent: exiting\n")
        return 2
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    fd = stdin.fileno()
    poll_s = max(0.05, min(1.0, args.timeout_s / 4))
    last = time.monotonic()
    tick = last
    # The main thread's CPU time (its thread id is the process id), read at each poll: whether it
    # computes is judged over the last poll only, not since the last heartbeat, whose window also
    # holds the work done before a stop.
    cpu_then, cpu_then_at = thread_cpu_s(args.pid, args.pid), last
    while True:
        ready, _, _ = select.select([fd], [], [], poll_s)
        now = time.monotonic()
        gap, tick = now - tick, now
        if gap > max(JUMP_MIN_S, JUMP_FACTOR * poll_s):
            # We were not scheduled for `gap` seconds: suspended with the worker.
            sys.stderr.write(f"elastic_ext guardian: clock jumped {gap:.1f}s (suspended?): "
                             f"restarting the {args.timeout_s:.1f}s heartbeat timeout\n")
            last = now
        if ready:
            data = os.read(fd, 4096)
            if not data:
                return 0
            last = now
            cpu_then, cpu_then_at = thread_cpu_s(args.pid, args.pid), now
            continue
        if os.getppid() != args.pid:
            return 0  # the worker is gone (a child holding the pipe open keeps EOF away)
        cpu_now = thread_cpu_s(args.pid, args.pid)
        computing = busy(cpu_then, cpu_now, now - cpu_then_at)
        cpu_then, cpu_then_at = cpu_now, now
        if now - last >= args.timeout_s:
            if computing:
                sys.stderr.write(f"elastic_ext guardian: worker {args.pid} sent no heartbeat for {now - last:.1f}s "
                                 "but its main thread ran on the CPU (a C call holding the GIL?): not a hang\n")
                last = now
                continue
            if os.getppid() == args.pid:
                # Before the kill: once the worker is dead its launcher may stop reading this stream.
                sys.stderr.write(f"elastic_ext guardian: worker {args.pid} sent no heartbeat for "
                                 f"{args.timeout_s:.1f}s (stopped or frozen): SIGKILL\n")
                sys.stderr.flush()
            kill()
            return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # No interpreter teardown (10 ms here): the guardian holds the worker's stderr, and the
    # launcher's driver records the worker's end when the last holder of that stream closes it.
    os._exit(code)

"""The driver runs each worker's command as its own child, with no Python middleman.

Horovod's driver starts every worker through ``safe_shell_exec.execute``:
a fresh Python interpreter (multiprocessing's spawn) starts the worker's
shell command, waits for it, and exits with its status; the driver learns
of the worker's end when that middleman has exited and both output streams
have closed. The middleman is there for one case: when the driver itself
is killed, it sees its pipe from the driver close and terminates the
worker's processes.

A failure's next round forms only once the failed worker's end is recorded,
and since the survivors ask for their ranks within a few milliseconds of
seeing its connections close (:mod:`elastic_ext.runtime.connections`), that
record is the last thing the round waits for. Through the middleman it
came 13 to 25 ms after the worker's sockets closed, here; as the shell's
parent the driver sees it in 1 to 2 ms.

Under the launcher, :func:`execute` (which replaces Horovod's for the
driver's process) starts the command as Horovod's middleman does (a shell,
in a session of its own), forwards its output with Horovod's prefixes,
terminates it as Horovod does when one of the driver's events is set
(:func:`terminate`), and returns the same exit status. The driver's death
is still covered, by a guard that is not on the exit's path: a ``sh``
reading a pipe that only the driver holds open. When the driver dies the
read ends and the guard sends the worker's process group SIGTERM, then
SIGKILL :data:`GRACE_S` later (Horovod's middleman: SIGTERM to the shell's
children, SIGKILL to those alive after 5 s). When the worker ends first,
the driver kills the guard before closing its end of the pipe.

A command of an elastic job that starts the workers' entry module
(:data:`WORKER_MODULE`) gets the job's secret on its stdin (:mod:`elastic_ext.control.store`), then
end of file; ssh carries it to a remote worker. Not its command line nor
its environment: Horovod writes the workers' environment into their
command lines, which ``ps`` shows every user of the machine, while a pipe
is readable only by the processes it connects.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Iterable, List, Optional, TextIO, Tuple

from elastic_ext.control import store
from elastic_ext.control.horovod_seam import Change

logger = logging.getLogger(__name__)

WORKER_MODULE = "elastic_ext.worker.entry"  # the workers' entry module (elastic_ext.launch.horovodrun)
GRACE_S = 5  # Horovod's GRACEFUL_TERMINATION_TIME_S
# $1: the worker's process group. `read` returns when the driver's end of stdin closes (its death).
# The group comes first on the pipe (no group: the driver died before it started one, nothing to end),
# then the pipe's end (the driver's death) signals it.
GUARD = (f'read group || exit 0; read _ ; kill -s TERM -- "-$group" 2>/dev/null; sleep {GRACE_S}; '
         'kill -s KILL -- "-$group" 2>/dev/null')



def execute(command: str, env: Optional[dict] = None, stdout: Optional[TextIO] = None,
            stderr: Optional[TextIO] = None, index: Optional[int] = None,
            events: Optional[Iterable[threading.Event]] = None,
            prefix_output_with_timestamp: bool = False) -> int:
    """Horovod's ``safe_shell_exec.execute`` (same arguments, output and exit status), with no middleman."""
    from horovod.runner.common.util.safe_shell_exec import prefix_connection
    from horovod.runner.util.threads import in_thread, on_event

    # What the worker's entry module reads it in: an elastic job's (Horovod writes HOROVOD_ELASTIC=1 there).
    secret = store.job_secret() is not None and f"-m {WORKER_MODULE} " in command and "HOROVOD_ELASTIC=1" in command
    # The guard runs before the command starts, and learns its group right after: a driver killed as the
    # command starts must not leave it unguarded.
    guard = start_guard()
    try:
        shell = subprocess.Popen(command, shell=True, env=env, stdin=subprocess.PIPE if secret else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, bufsize=0)
    except BaseException:
        stop_guard(guard)
        raise
    arm_guard(guard, shell.pid)
    if secret:
        _send_secret(shell)
    forwarders = [in_thread(target=prefix_connection, args=(stream, sys.stdout if out is None else out,
                                                            name, index, prefix_output_with_timestamp))
                  for stream, out, name in ((shell.stdout, stdout, "stdout"), (shell.stderr, stderr, "stderr"))]
    stop = threading.Event()
    for event in events or []:
        on_event(event, terminate, args=(shell,), stop=stop, silent=True)
    try:
        while True:
            try:
                code = shell.wait()
                break
            except BaseException:  # interrupted, as Horovod's execute: end the worker, then wait for it
                terminate(shell)
    finally:
        stop.set()
        stop_guard(guard)
    for forwarder in forwarders:
        forwarder.join()
    return code if code >= 0 else 128 - code  # killed by a signal: a shell's status, as Horovod's middleman


def _send_secret(shell: subprocess.Popen) -> None:
    """The job's secret on the worker's stdin (through ssh for a remote one), then end of file."""
    try:
        store.send_secret(shell.stdin)
    except OSError as exc:  # the shell ended already: its exit is what the driver records
        logger.warning("elastic_ext: could not pass the job's secret to a worker: %s", exc)
    finally:
        try:
            shell.stdin.close()
        except OSError as exc:  # the shell ended before it read it: its exit is what the driver records
            logger.debug("elastic_ext: closing a worker's stdin: %s", exc)


def terminate(shell: subprocess.Popen) -> None:
    """Horovod's ``terminate_executor_shell_and_children`` for a shell that is this process's own child.

    The same steps: SIGTERM to the shell's children, SIGKILL to those (and
    their descendants) alive :data:`GRACE_S` later, the shell stopped, then
    sent SIGTERM, and SIGKILL if it is alive :data:`GRACE_S` after. Horovod's
    waits for the shell with psutil, which reaps a child of the caller: the
    ``Popen`` waiting for the shell in :func:`execute` would then find no
    child and report exit status 0 for a worker the driver had terminated.
    Here the shell is waited for through its ``Popen``, which is safe beside
    another thread's wait and keeps its status.
    """
    import psutil

    if shell.poll() is not None:
        return
    try:
        children = psutil.Process(shell.pid).children()
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=GRACE_S)  # not this process's children: nothing is reaped
    shell.send_signal(signal.SIGSTOP)  # no new children from here on (Popen ignores an ended shell)
    for child in alive:
        try:
            for descendant in child.children(recursive=True):
                try:
                    descendant.kill()
                except psutil.NoSuchProcess:
                    pass
            child.kill()
        except psutil.NoSuchProcess:
            pass
    shell.terminate()  # fatal by default, so it ends a stopped shell too
    try:
        shell.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        shell.kill()


def start_guard(group: Optional[int] = None) -> Optional[Tuple[subprocess.Popen, int]]:
    """The ``sh`` that ends a process group when the driver dies (module docstring; the discovery script's
    too), and the driver's end of its pipe; None where no shell could start (the group then runs unguarded).
    The group is ``group``, or the one :func:`arm_guard` gives it later."""
    read_end, write_end = os.pipe()
    try:
        guard = subprocess.Popen(["/bin/sh", "-c", GUARD, "elastic_ext-worker-guard"],
                                 stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    if group is not None:
        arm_guard((guard, write_end), group)
    return guard, write_end


def arm_guard(guarded: Optional[Tuple[subprocess.Popen, int]], group: int) -> None:
    """Tells a guard started by :func:`start_guard` which process group it ends."""
    if guarded is None:
        return
    try:
        os.write(guarded[1], f"{group}\n".encode())
    except OSError as exc:  # the guard is gone: the group runs unguarded, as where no shell could start
        logger.warning("elastic_ext: the guard of process group %d is gone: %s", group, exc)


def stop_guard(guarded: Optional[Tuple[subprocess.Popen, int]]) -> None:
    """Kills the guard, then closes the pipe: a guard that saw the pipe close would signal the group."""
    if guarded is None:
        return
    guard, write_end = guarded
    try:
        guard.send_signal(signal.SIGKILL)
        guard.wait()
    finally:
        os.close(write_end)


def changes() -> List[Change]:
    """Horovod's ``safe_shell_exec.execute`` as this (the driver's) process runs worker commands:
    :func:`execute` (made by :func:`elastic_ext.launch.horovod_changes.install_launcher`)."""
    from horovod.runner.common.util import safe_shell_exec

    return [(safe_shell_exec, "execute", execute)]


__all__ = ["GRACE_S", "GUARD", "arm_guard", "changes", "execute", "start_guard", "stop_guard", "terminate"]

"""Restart in place: a worker killed by Gloo inside a forming round keeps its slot.

Horovod hands out a round's ranks before Gloo connects its members. When a
member dies in that window (a newcomer killed while it starts, a survivor
killed in its reset), the others wait for it inside the native
``hvd.init()`` and end in ``std::terminate`` (``gloo::IoException``, "Wait
timeout"), which no Python code can catch. Each of those exits is a failure
to Horovod's driver, and when every member of a round has failed the driver
ends the job ("failure count == N"). That was most of ``bench.soak``'s job
deaths.

When the job has a checkpoint directory, ``elastic-horovodrun`` sets
``ELASTIC_EXT_RESTART_IN_PLACE=1`` for its workers, and the
launcher's entry module (:mod:`elastic_ext.worker.entry`) forks before the
script runs (Linux). The parent, the process
Horovod's driver started and watches, only waits (the *keeper*); the child
runs the script. When the child dies of SIGABRT while inside ``hvd.init()``,
the keeper forks a new child at the same point of the script. It starts
Horovod as a world of one, builds its model, and at ``@elastic_ext.run``
re-initialises, which asks the driver for a rank in its next round as a
reset does (:mod:`elastic_ext.worker.prestart` does both). The driver never sees
the worker exit: the round is recorded with the dead member as the only
failure, its host is blacklisted, and the job goes on.

A restarted child holds no commit. When every member of the round was
restarted, the job resumes from its newest durable checkpoint (``run()``
refuses a restart without a checkpoint directory rather than start the
training again). Any other end of the child (an exit, SIGKILL, an abort
outside ``hvd.init()``) ends the keeper the same way, so the driver sees
what it would have seen. A child whose slot the driver's current round
does not hold (its host removed or blacklisted; ``python -m
elastic_ext.launch.horovodrun`` publishes the round's slots) is not restarted: it
would abort again in its next ``hvd.init()``. Nor is one after
:data:`MAX_RESTARTS_WITHOUT_JOINING` restarts without a real ``hvd.init()``
completing (under plain ``horovodrun``, the only limit).

A restart after the child ended its wait because its round lost a member
(:mod:`elastic_ext.worker.round_watch`), in a later round than the previous such
restart, does not count toward that limit: another worker's exit, which
the driver saw and accounts for, ended the round, and the driver has
moved on. Otherwise three newcomers killed one after the other while they
start (a spot pool reclaiming instances as they boot) would break three
rounds in a row, and every other worker's keeper would give up at the
third: the job would end with a failure for every member of the round.
Those restarts have their own, larger limit,
:data:`MAX_LOST_ROUNDS_WITHOUT_JOINING`: a slot whose new worker dies at
every start would otherwise cost a round and a restart of every other
worker forever (``--reset-limit`` bounds it on Horovod's side).

The keeper ignores SIGTERM, SIGINT, SIGHUP and SIGUSR1: the driver's
shutdown and a scheduler's preemption signal the whole process tree, and
the child handles them (a SIGTERM, or a SIGUSR1 preemption notice, is a
leave at the next commit). The child dies with its keeper
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import sys
from typing import Any, Mapping, MutableMapping, Optional

from elastic_ext.worker import round_watch
from elastic_ext.config import ENV_RESTARTED_IN_PLACE, elastic_horovodrun, restart_in_place

MAX_RESTARTS_WITHOUT_JOINING = 2
MAX_LOST_ROUNDS_WITHOUT_JOINING = 8
IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1

# Where the child is, in bytes the keeper reads after the child's end.
OUTSIDE_INIT, IN_INIT = 0, 1
PHASE, JOINED = 0, 1  # offsets: the phase, and 1 once a hvd.init() with the job's peers completed
LOST = slice(2, 10)   # the round whose loss ended the child's wait, plus one (0: none), little-endian
LOCAL_RANK = slice(10, 14)  # the local rank its last joined hvd.init() gave it, plus one (0: none)
SHARED_BYTES = 14

_shared: Optional[mmap.mmap] = None  # in a child of a keeper: the bytes its keeper reads


def active() -> bool:
    """True in a script's process whose keeper restarts it (see the module docstring)."""
    return _shared is not None


def enter_init() -> None:
    if _shared is not None:
        _shared[PHASE] = IN_INIT


def leave_init(joined: bool, local_rank: Optional[int] = None) -> None:
    """After ``hvd.init()`` returned; ``joined``: it was a real one, not a world of one.

    ``local_rank``: what that init gave this worker. The driver may move a
    survivor to a lower local rank (:mod:`elastic_ext.launch.driver`), and
    a restarted child must ask for a rank under the slot it holds now.
    """
    if _shared is not None:
        _shared[PHASE] = OUTSIDE_INIT
        if joined:
            _shared[JOINED] = 1
            if local_rank is not None:
                _shared[LOCAL_RANK] = (local_rank + 1).to_bytes(4, "little")


def lost_round(round_id: int) -> None:
    """Ends this worker's wait in ``hvd.init()``: a member of its round ``round_id`` died.

    Tells the keeper which round, then aborts (the ``on_lost`` of
    :func:`elastic_ext.worker.round_watch.watch` for a worker that has a keeper).
    """
    if _shared is not None:
        _shared[LOST] = (round_id + 1).to_bytes(8, "little")
    round_watch.abort(round_id)


def restarts(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times the keeper restarted this worker in place (0: the first child, or no keeper)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get(ENV_RESTARTED_IN_PLACE, "0"))
    except ValueError:
        return 0


def restartable(status: int, phase: int) -> bool:
    """True for a child that died of SIGABRT inside ``hvd.init()`` (``status`` as ``os.waitpid`` gives it)."""
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT and phase == IN_INIT


def install(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Becomes the keeper (see the module docstring) when asked to; returns True in the child.

    In the keeper this never returns: it ends as its last child ended.
    Returns False, doing nothing, when not asked to, outside an elastic
    ``horovodrun``, or off Linux.
    """
    global _shared
    env = os.environ if environ is None else environ
    if not elastic_horovodrun(env) or not sys.platform.startswith("linux") or not restart_in_place(env):
        return False
    if ENV_RESTARTED_IN_PLACE in env:
        return False  # a process the script started (the guardian, a data worker) inherited the variable
    keeper = os.getpid()
    dispositions = {sig: signal.getsignal(sig) for sig in IGNORED}
    for sig in IGNORED:  # before the first fork: a SIGTERM in the child's first moments must not end the keeper
        signal.signal(sig, signal.SIG_IGN)
    count = without_joining = lost_without_joining = 0
    last_lost = -1
    while True:
        shared = mmap.mmap(-1, SHARED_BYTES)  # anonymous and shared with the child
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        pid = os.fork()
        if pid == 0:
            for sig, disposition in dispositions.items():
                signal.signal(sig, disposition)
            _die_with(keeper)
            os.environ[ENV_RESTARTED_IN_PLACE] = str(count)
            _shared = shared
            return True
        status = _wait(pid)
        phase, joined = shared[PHASE], shared[JOINED]
        lost = int.from_bytes(shared[LOST], "little") - 1
        local_rank = int.from_bytes(shared[LOCAL_RANK], "little") - 1
        shared.close()
        if local_rank >= 0 and isinstance(env, MutableMapping):
            env["HOROVOD_LOCAL_RANK"] = str(local_rank)  # the slot the driver knows this worker by now
        moved_on = lost > last_lost  # a later round than the last one lost: the driver moved on
        last_lost = max(last_lost, lost)
        if joined:
            without_joining = lost_without_joining = 0
        elif moved_on:
            lost_without_joining += 1
        else:
            without_joining += 1
        if not restartable(status, phase) or round_watch.slot_assigned(env) is False:
            _end_as(status)  # an end the driver must see, or removed from the job: nothing to restart for
        if without_joining > MAX_RESTARTS_WITHOUT_JOINING or lost_without_joining > MAX_LOST_ROUNDS_WITHOUT_JOINING:
            print(f"elastic_ext: worker {pid} died in hvd.init() again; not restarting it (restarts since it "
                  f"last joined its job: {without_joining + lost_without_joining}, {lost_without_joining} of them "
                  f"after a round lost a member)", file=sys.stderr, flush=True)
            _end_as(status)
        count += 1
        print(f"elastic_ext: worker {pid} died in hvd.init() while its job re-formed; restarting it in place "
              f"(restart {count}; it asks for a rank in the driver's next round)", file=sys.stderr, flush=True)


def _die_with(keeper: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != keeper:  # the keeper died before prctl took effect
        os._exit(1)


def _wait(pid: int) -> int:
    while True:
        try:
            waited, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return 1 << 8  # cannot happen for our own child; treat as exit code 1
        if waited == pid and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
            return status


def _end_as(status: int) -> Any:
    """Ends the keeper with the child's exit code or signal, so the driver sees what the child did."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP have no handler to reset
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))

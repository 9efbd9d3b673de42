"""``elastic-horovodrun ARGS`` (``python -m elastic_ext.launch.horovodrun ARGS``): the way to launch a job.

The arguments are ``horovodrun``'s. Each worker's Python is started through
:mod:`elastic_ext.launch.worker`, which does in the worker what must happen
before the user's code (restart in place, the newcomer's side of an early
start, Gloo's first timeout, SIGTERM as "leave") and then runs the script:
``python train.py`` becomes ``python -m elastic_ext.launch.worker train.py``
(a command that is not a Python script or module runs as given, without
those). Outside elastic mode the driver is plain ``horovodrun``'s; in
elastic mode it is Horovod's ``ElasticDriver`` with the changes of
:mod:`elastic_ext.launch.driver` (a failure's next round holds only the
survivors, and the failed slot's new worker joins while they train; a host
is blacklisted only when it lost every worker; the rounds are published to
the workers; a replaced worker's late exit is not charged to its successor),
with :mod:`elastic_ext.launch.noticed_hosts` (a host with a preemption
notice leaves discovery; SIGUSR1, Slurm's ``--signal``, reaches every worker),
and with :mod:`elastic_ext.launch.discovery_runs` (the discovery script runs
outside the driver's host lock, so no round waits for it, and as a plain
child process rather than through a fresh Python middleman; host names
that could reach a shell are refused), with
:mod:`elastic_ext.launch.store_guard` (the rendezvous server serves only
the job's hosts, loads no pickle from the network, and takes the
launcher's keys only with the job's secret, which each worker receives on
its stdin), with :mod:`elastic_ext.launch.store_serving` (a listen queue
that takes a thousand workers' bursts, threads reused rather than one
started per request), and with
:mod:`elastic_ext.launch.rendezvous_wait` (a Gloo peer's read of a key its
peer has not written yet is answered when it is written, not "404, ask
again in 10 ms"), and with :mod:`elastic_ext.launch.worker_runs` (each
worker's command runs as the driver's own child, not through a fresh Python
middleman, so a failed worker's end, which its round waits for, is recorded
at once). Horovod's build checks (was it built with Gloo? with MPI?), which import
TensorFlow before the first worker starts, are answered from a cache
(:mod:`elastic_ext.launch.build_check`).

The workers restart in place (:mod:`elastic_ext.launch.keeper`) when the
job has durable checkpoints (``ELASTIC_EXT_CHECKPOINT_DIR``): a restarted
worker holds no commit.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, List, MutableMapping, Optional, Sequence

from elastic_ext.config import ENV_CHECKPOINT_DIR, ENV_LAUNCHER, ENV_MIN_NP, ENV_RESTART_IN_PLACE
from elastic_ext.errors import ConfigError
from elastic_ext.launch import (build_check, discovery_runs, driver, horovod_seam, noticed_hosts, rendezvous_wait,
                                ssh_keepalive, store, store_guard, store_serving, worker_runs)


def restart_in_place_when_checkpointing(environ: MutableMapping[str, str]) -> bool:
    """Tells the workers to restart in place exactly when the job has durable checkpoints; returns which.

    A restarted worker holds no commit: with a checkpoint directory a round
    whose every member was restarted resumes from the newest checkpoint;
    without one it could only train again from scratch.
    """
    on = bool(environ.get(ENV_CHECKPOINT_DIR, "").strip())
    environ[ENV_RESTART_IN_PLACE] = "1" if on else "0"
    return on


# Horovod 0.28.1's tuning parameters (fusion threshold, cycle time) live in one vector, and a value set
# ("fixed") by its variable or flag is taken out of it. The hvd.init() that follows a reset sets the
# fusion threshold's default first, by the index it had before any was taken out: with both fixed the
# vector is empty and the worker crashes (SIGSEGV in ParameterManager::BayesianParameter::SetValue).
# tools/horovod_patches/07-fixed-tuning-after-reset.patch fixes it in the Horovod the setup builds.
_TUNING = (("HOROVOD_FUSION_THRESHOLD", "fusion_threshold_mb", "--fusion-threshold-mb"),
           ("HOROVOD_CYCLE_TIME", "cycle_time_ms", "--cycle-time-ms"))


def crashing_tuning(args: Any, environ: MutableMapping[str, str],
                    patches: Optional[Sequence[str]] = None) -> Optional[str]:
    """Why an elastic job's workers would crash at their first reset with these settings, or None.

    ``args``: horovodrun's parsed arguments; ``environ``: the environment the workers inherit;
    ``patches``: the build patches of the workers' Horovod (default: the installed one's,
    :func:`elastic_ext.launch.horovod_seam.build_patches`).
    """
    fixed = [flag if getattr(args, dest, None) is not None else name
             for name, dest, flag in _TUNING if getattr(args, dest, None) is not None or environ.get(name)]
    if len(fixed) < len(_TUNING):
        return None
    if horovod_seam.TUNING_FIX in (horovod_seam.build_patches() if patches is None else patches):
        return None
    return (f"{' and '.join(fixed)} are both set: Horovod 0.28.1's workers crash (SIGSEGV) in the hvd.init() "
            "after an elastic reset when the fusion threshold and the cycle time are both fixed; set one of them, "
            f"or build Horovod with tools/setup.sh (its patch {horovod_seam.TUNING_FIX} fixes the crash)")


WORKER_MODULE = worker_runs.WORKER_MODULE
# Interpreter options that may stand before the script: alone, or with a value (-W, -X).
_FLAGS = {"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-d", "-v"}
_FLAGS_WITH_VALUE = {"-W", "-X"}


def worker_command(command: List[str]) -> List[str]:
    """``command`` with its Python started through :mod:`elastic_ext.launch.worker`.

    ``python [flags] SCRIPT ...`` and ``python [flags] -m MODULE ...`` gain
    ``-m elastic_ext.launch.worker`` after the flags; anything else (a shell
    script, ``python -c``, a command already through the worker) is returned as it is.
    """
    if not command or not os.path.basename(command[0]).startswith("python"):
        return list(command)
    i = 1
    while i < len(command) and (command[i] in _FLAGS or command[i] in _FLAGS_WITH_VALUE):
        i += 2 if command[i] in _FLAGS_WITH_VALUE else 1
    rest = command[i:]
    if not rest or rest[0] == "-c" or rest[:2] == ["-m", WORKER_MODULE] or (rest[0].startswith("-") and rest[0] != "-m"):
        return list(command)
    return [*command[:i], "-m", WORKER_MODULE, *rest]


def _through_the_worker_entry() -> None:
    """Makes Horovod's command line start every worker through :func:`worker_command`."""
    from horovod.runner import launch

    parse_args = launch.parse_args

    def parse_and_rewrite() -> Any:
        args = parse_args()
        command = worker_command(args.command or [])
        if args.min_num_proc is not None:  # an elastic job: its workers choose their resets' Gloo timeout by it
            crash = crashing_tuning(args, os.environ)
            if crash:
                sys.exit(f"elastic-horovodrun: {crash}")
            os.environ[ENV_MIN_NP] = str(args.min_num_proc)
        if command != (args.command or []):
            os.environ[ENV_LAUNCHER] = "1"  # the workers' entry module runs: early start is possible
        elif command:  # (no command at all: --check-build, --version)
            logging.warning("elastic_ext: %r is not 'python SCRIPT' or 'python -m MODULE': the workers start as "
                            "given, without what the launcher does before user code (restart in place, early start "
                            "of newcomers, SIGTERM as a leave while the job re-forms)", args.command)
        args.command = command
        return args

    launch.parse_args = parse_and_rewrite


def main(argv: Optional[List[str]] = None) -> None:
    """The console script ``elastic-horovodrun``: ``horovodrun``'s arguments, the launcher's behaviour.

    Stops (exit status 1, one message naming each difference) before anything of Horovod is changed when
    the installed Horovod is not the one the launcher changes (:mod:`elastic_ext.launch.horovod_seam`).
    """
    try:
        horovod_seam.check_launcher()
    except ConfigError as exc:
        sys.exit(f"elastic-horovodrun: {exc}")
    restart_in_place_when_checkpointing(os.environ)
    store.new_job_secret()  # the workers get it on their stdin (worker_runs), never on a command line
    store_guard.install()  # no pickle from the network; the launcher's keys need the secret; the job's hosts only
    store_serving.install()  # a listen queue for a thousand workers' bursts; threads reused, not one per request
    driver.install()
    noticed_hosts.install()  # preemption notices: noticed hosts leave discovery; Slurm's signal reaches every worker
    discovery_runs.install()  # the discovery script outside the host lock, with no Python middleman
    rendezvous_wait.install()  # a Gloo peer's read of a key not yet written is answered when it is written
    worker_runs.install()  # each worker's command a child of the driver: its end is recorded at once
    try:
        ssh_keepalive.install()  # keepalives, and ssh_host_keys instead of Horovod's StrictHostKeyChecking=no
    except ConfigError as exc:
        sys.exit(f"elastic-horovodrun: {exc}")
    build_check.install()  # Horovod's Gloo/MPI checks import TensorFlow: about 3 s before any worker starts
    _through_the_worker_entry()
    from horovod.runner.launch import run_commandline
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()


if __name__ == "__main__":
    main()

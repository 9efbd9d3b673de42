"""Horovod's command line under ``elastic-horovodrun``: every worker through the worker entry, settings checked.

:func:`worker_entry_changes` (made by
:func:`elastic_ext.launch.horovod_changes.install_launcher`) makes Horovod's
``parse_args`` rewrite the workers' command (:func:`worker_command`: ``python
train.py`` becomes ``python -m elastic_ext.worker.entry train.py``), tell the
workers the job's ``--min-np``, and refuse a pair of tuning settings that
crashes an elastic job's workers (:func:`crashing_tuning`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, List, MutableMapping, Optional, Sequence

from elastic_ext.config import ENV_LAUNCHER, ENV_MIN_NP
from elastic_ext.control import horovod_seam
from elastic_ext.launch import gloo_exchange
from elastic_ext.launch import worker_runs
from elastic_ext.control.horovod_seam import Change


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
    :func:`elastic_ext.control.horovod_seam.build_patches`).
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
    """``command`` with its Python started through :mod:`elastic_ext.worker.entry`.

    ``python [flags] SCRIPT ...`` and ``python [flags] -m MODULE ...`` gain
    ``-m elastic_ext.worker.entry`` after the flags; anything else (a shell
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


def worker_entry_changes() -> List[Change]:
    """Horovod's command line parsed so that every worker starts through :func:`worker_command`
    (made by :func:`elastic_ext.launch.horovod_changes.install_launcher`)."""
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
        if gloo_exchange.PATCH in horovod_seam.build_patches():
            os.environ[gloo_exchange.ENV] = "1"  # this process's store answers it (gloo_exchange)
        if command != (args.command or []):
            os.environ[ENV_LAUNCHER] = "1"  # the workers' entry module runs: early start is possible
        elif command:  # (no command at all: --check-build, --version)
            logging.warning("elastic_ext: %r is not 'python SCRIPT' or 'python -m MODULE': the workers start as "
                            "given, without what the launcher does before user code (restart in place, early start "
                            "of newcomers, SIGTERM as a leave while the job re-forms)", args.command)
        args.command = command
        return args

    return [(launch, "parse_args", parse_and_rewrite)]


__all__ = ["WORKER_MODULE", "crashing_tuning", "worker_command", "worker_entry_changes"]

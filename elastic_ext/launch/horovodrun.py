"""``elastic-horovodrun ARGS`` (``python -m elastic_ext.launch.horovodrun ARGS``): the way to launch a job.

The arguments are ``horovodrun``'s. Each worker's Python is started through
:mod:`elastic_ext.worker.entry`, which does in the worker what must happen
before the user's code (restart in place, the newcomer's side of an early
start, Gloo's first timeout, SIGTERM as "leave") and then runs the script:
``python train.py`` becomes ``python -m elastic_ext.worker.entry train.py``
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
that takes a thousand workers' bursts, and one loop that serves and holds
requests without a thread each), and with :mod:`elastic_ext.launch.worker_runs` (each
worker's command runs as the driver's own child, not through a fresh Python
middleman, so a failed worker's end, which its round waits for, is recorded
at once). Horovod's build checks (was it built with Gloo? with MPI?), which import
TensorFlow before the first worker starts, are answered from a cache
(:mod:`elastic_ext.launch.build_check`).

The workers restart in place (:mod:`elastic_ext.worker.keeper`) when the
job has durable checkpoints (``ELASTIC_EXT_CHECKPOINT_DIR``): a restarted
worker holds no commit.
"""

from __future__ import annotations

import os
import sys
from typing import List, MutableMapping, Optional

from elastic_ext.config import ENV_CHECKPOINT_DIR, ENV_RESTART_IN_PLACE
from elastic_ext.errors import ConfigError
from elastic_ext.control import horovod_seam, store
from elastic_ext.launch import horovod_changes


def restart_in_place_when_checkpointing(environ: MutableMapping[str, str]) -> bool:
    """Tells the workers to restart in place exactly when the job has durable checkpoints; returns which.

    A restarted worker holds no commit: with a checkpoint directory a round
    whose every member was restarted resumes from the newest checkpoint;
    without one it could only train again from scratch.
    """
    on = bool(environ.get(ENV_CHECKPOINT_DIR, "").strip())
    environ[ENV_RESTART_IN_PLACE] = "1" if on else "0"
    return on


def main(argv: Optional[List[str]] = None) -> None:
    """The console script ``elastic-horovodrun``: ``horovodrun``'s arguments, the launcher's behaviour.

    Stops (exit status 1, one message naming each difference) before anything of Horovod is changed when
    the installed Horovod is not the one the launcher changes (:mod:`elastic_ext.control.horovod_seam`).
    """
    try:
        horovod_seam.check_launcher()
    except ConfigError as exc:
        sys.exit(f"elastic-horovodrun: {exc}")
    restart_in_place_when_checkpointing(os.environ)
    store.new_job_secret()  # the workers get it on their stdin (worker_runs), never on a command line
    try:
        horovod_changes.install_launcher()  # every change, in its order: launch/horovod_changes.py
    except ConfigError as exc:  # the ssh_host_keys setting, or another ELASTIC_EXT_* variable
        sys.exit(f"elastic-horovodrun: {exc}")
    from horovod.runner.launch import run_commandline
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()


if __name__ == "__main__":
    main()

"""Restart a whole elastic job that died, so it resumes from its newest durable checkpoint.

Some failures end a Horovod elastic job whatever the workers do: a newcomer
killed while the survivors wait for it in the rendezvous leaves them in a
round that can never complete, Gloo's store wait ends in ``std::terminate``
(no Python code can catch it), and when every worker of a round has failed
Horovod's driver stops ("failure count == N"). Slurm's requeue does the same
for a batch job. This is that requeue for any launcher::

    python -m elastic_ext.launch.supervise --max-restarts 5 -- \\
        horovodrun --min-np 4 --max-np 16 --host-discovery-script ... python train.py

With ``ELASTIC_EXT_CHECKPOINT_DIR`` set, each restarted job's first sync
finds no survivor and resumes from the newest valid checkpoint at whatever
world size the discovery script gives (every sample still exactly once).
Without it a restart starts from scratch, which this refuses unless
``--allow-no-checkpoint`` is given.

Rules: a run that exits 0 ends the supervisor with 0. A run that fails is
started again after ``--backoff-s``, at most ``--max-restarts`` times; then
the supervisor exits with the run's code. SIGINT, SIGTERM and SIGHUP are
passed on to the run and stop the restarts (one that arrives while a run is
being started reaches that run). Every restart is written as a ``job_restart``
event to ``ELASTIC_EXT_EVENTS_PATH`` when that is set, and the job sees
``ELASTIC_EXT_RESTART`` (0 for the first run, k for the k-th restart).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

from elastic_ext.config import ENV_CHECKPOINT_DIR, ENV_EVENTS_PATH, ENV_RESTART
from elastic_ext.events import JOB_RESTART, EventLog

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a closed terminal ends the job as Ctrl-C does


def supervise(command: List[str], max_restarts: int, backoff_s: float, log=print) -> int:
    """Runs ``command`` until it exits 0 or has failed ``max_restarts + 1`` times; returns its last exit code."""
    stopping: dict = {"signal": None}
    child: Optional[subprocess.Popen] = None

    def forward(signum, frame):
        stopping["signal"] = signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)
            stopping["sent_to"] = child.pid

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    events = EventLog(os.environ.get(ENV_EVENTS_PATH) or None, lambda: -1, lambda: 0)
    restarts = 0
    try:
        while True:
            started = time.time()
            child = subprocess.Popen(command, env={**os.environ, ENV_RESTART: str(restarts)})
            if stopping["signal"] is not None and stopping.get("sent_to") != child.pid:
                child.send_signal(stopping["signal"])  # it came while Popen ran: forward() saw the previous child
            code = child.wait()
            if code == 0 or stopping["signal"] is not None or restarts >= max_restarts:
                if code != 0 and stopping["signal"] is None:
                    log(f"elastic_ext.launch.supervise: the job failed with exit code {code}; "
                        f"{restarts} restarts used of --max-restarts {max_restarts}: giving up")
                return code
            restarts += 1
            log(f"elastic_ext.launch.supervise: the job failed with exit code {code} after {time.time() - started:.0f}s; "
                f"restart {restarts} of {max_restarts} in {backoff_s:.0f}s (it resumes from the newest checkpoint)")
            events.emit(JOB_RESTART, exit_code=code, restart=restarts, max_restarts=max_restarts,
                        ran_s=time.time() - started)
            time.sleep(backoff_s)
            if stopping["signal"] is not None:
                return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after the first run (default 3)")
    parser.add_argument("--backoff-s", type=float, default=5.0, help="seconds between a failure and the restart")
    parser.add_argument("--allow-no-checkpoint", action="store_true",
                        help=f"restart even without {ENV_CHECKPOINT_DIR} (a restart then starts from scratch)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launcher command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the job's command after --, e.g. -- horovodrun ... python train.py")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts ({args.max_restarts}) must be >= 0")
    if args.backoff_s < 0:
        parser.error(f"--backoff-s ({args.backoff_s}) must be >= 0")
    directory = os.environ.get(ENV_CHECKPOINT_DIR, "")
    if not directory.strip() and not args.allow_no_checkpoint and args.max_restarts:
        # A blank value is "not set" for the workers too (ElasticConfig): checkpoints would be off.
        parser.error(f"{ENV_CHECKPOINT_DIR} is not set{f' (it is {directory!r})' if directory else ''}: a restarted "
                     "job would start from scratch; set it (durable checkpoints) or pass --allow-no-checkpoint")
    return supervise(command, args.max_restarts, args.backoff_s, log=lambda text: print(text, file=sys.stderr,
                                                                                         flush=True))


if __name__ == "__main__":
    sys.exit(main())

"""``python -m elastic_ext.worker.entry SCRIPT ARGS`` (or ``-m MODULE ARGS``): a worker's entry under the launcher.

``elastic-horovodrun`` starts each worker's Python through this module. It
does, in the worker and before the user's code runs, what an elastic worker
needs at that moment and what ``import elastic_ext`` therefore never does,
after one check that the installed Horovod is the one these steps change
(:mod:`elastic_ext.control.horovod_seam`; the worker stops with one message
naming each difference otherwise):

0. the job's secret, on stdin from the launcher's driver
   (:mod:`elastic_ext.control.store`): the driver takes this worker's
   early-start and notice writes only with it;
1. restart in place (:mod:`elastic_ext.worker.keeper`): this process becomes
   the keeper and forks the one that runs the script, when the job restarts
   workers in place;
2. Horovod's changes in a worker (:mod:`elastic_ext.worker.horovod_changes`):
   one wrapper of ``hvd.init()`` runs the newcomer's side of an early start
   (:mod:`elastic_ext.worker.newcomer`: a newcomer the survivors started
   early builds its model in a world of one, its rank queries answered
   with its launched slot) and then makes Horovod's PyTorch binding wait
   for its collectives without spinning on a core
   (:mod:`elastic_ext.worker.torch_wait`); until a newcomer announces itself
   it exits when the driver dismisses it (a member of its round failed
   meanwhile);
3. Gloo's timeout for the first ``hvd.init()`` (:mod:`elastic_ext.worker.gloo_timeout`),
   the same as the survivors' resets wait;
4. SIGTERM means "leave at the first commit" (:mod:`elastic_ext.worker.sigterm`),
   also while the script builds its model and the job re-forms;
5. a preemption notice (the cloud's metadata endpoint, Slurm's signal) means
   the same (:mod:`elastic_ext.worker.notices`);
6. PyTorch's allocator puts large tensors in huge pages, so that a killed
   worker's links close sooner (:mod:`elastic_ext.worker.torch_pages`).

Then it runs the script as ``__main__`` in this interpreter, with
``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would set them.
Steps 0 to 5 do nothing outside a worker of an elastic ``horovodrun`` but
the collective wait.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = "usage: python -m elastic_ext.worker.entry (SCRIPT | -m MODULE) [ARGS...]"


def receive_secret() -> bool:
    """Step 0: the job's secret, which the launcher's driver writes on this worker's stdin (elastic jobs only)."""
    from elastic_ext.config import elastic_horovodrun, launched
    from elastic_ext.control import store

    stdin = getattr(sys.stdin, "buffer", None)
    if not elastic_horovodrun() or stdin is None or sys.stdin.isatty():
        return False  # not an elastic job's worker, or a terminal: nobody writes a secret there
    return store.receive_secret(stdin, expected=launched())


def check_horovod() -> None:
    """Before step 0: stops this worker (exit status 1, one message naming each difference) when the installed
    Horovod is not the one the steps change (:func:`elastic_ext.control.horovod_seam.check_worker`)."""
    from elastic_ext.config import elastic_horovodrun
    from elastic_ext.errors import ConfigError
    from elastic_ext.control import horovod_seam

    try:
        horovod_seam.check_worker(elastic=elastic_horovodrun())
    except ConfigError as exc:
        sys.exit(f"elastic_ext worker: {exc}")


def prepare() -> None:
    """Steps 0 to 6 of the module docstring, in that order (the keeper forks before anything else runs)."""
    from elastic_ext.worker import horovod_changes
    from elastic_ext.worker import gloo_timeout, keeper, newcomer, notices, sigterm, torch_pages

    receive_secret()
    keeper.install()
    horovod_changes.install_worker()  # one wrapper of hvd.init (early start, round watch, then torch's wait)
    newcomer.watch_dismissal()
    gloo_timeout.first_rendezvous_timeout()
    sigterm.install_early_sigterm()
    notices.install()
    torch_pages.install()


def main(argv: Optional[List[str]] = None) -> None:
    """Prepares this worker, then runs its script or module as ``__main__``.

    Raises:
        SystemExit: no script or module was named (exit code 2, with :data:`USAGE`), or the installed
            Horovod is not the one the entry changes (exit code 1, with each difference).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    check_horovod()
    prepare()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

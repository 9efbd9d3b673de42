"""``python -m elastic_ext.launch.worker SCRIPT ARGS`` (or ``-m MODULE ARGS``): a worker's entry under the launcher.

``elastic-horovodrun`` starts each worker's Python through this module. It
does, in the worker and before the user's code runs, what an elastic worker
needs at that moment and what ``import elastic_ext`` therefore never does:

1. PyTorch's allocator puts large tensors in huge pages, so that a killed
   worker's links close sooner (:mod:`elastic_ext.launch.torch_pages`): an
   environment variable, read at PyTorch's first allocation;
2. restart in place (:mod:`elastic_ext.launch.keeper`): this process becomes
   the keeper and forks the one that runs the script, when the job restarts
   workers in place;
3. the newcomer's side of an early start (:mod:`elastic_ext.launch.newcomer`):
   Horovod's ``hvd.init()`` and rank queries are wrapped, so a newcomer the
   survivors started early builds its model in a world of one, and until it
   announces itself it exits when the driver dismisses it (a member of its
   round failed meanwhile);
4. Gloo's timeout for the first ``hvd.init()`` (:mod:`elastic_ext.launch.gloo_timeout`),
   the same as the survivors' resets wait;
5. SIGTERM means "leave at the first commit" (:mod:`elastic_ext.launch.sigterm`),
   also while the script builds its model and the job re-forms;
6. a preemption notice (the cloud's metadata endpoint, Slurm's signal) means
   the same (:mod:`elastic_ext.launch.notices`);
7. Horovod's PyTorch binding waits for its collectives without spinning on a
   core (:mod:`elastic_ext.launch.torch_wait`).

Before all that, when the host keeps a spare (:mod:`elastic_ext.launch.spare`:
a process of the same job that already imported PyTorch), this process
hands it the slot and only relays the worker's end and signals; the spare's
worker then does steps 1 to 7. Otherwise this process starts a spare for
the next new worker on the host.

``python -m elastic_ext.launch.worker --spare [--next] SCRIPT`` is that spare
(started by an entry, :func:`elastic_ext.launch.spare.start`; never by hand).

Then it runs the script as ``__main__`` in this interpreter, with
``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would set them.
Steps 2 to 6 do nothing outside a worker of an elastic ``horovodrun``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = "usage: python -m elastic_ext.launch.worker (SCRIPT | -m MODULE) [ARGS...]"


def prepare() -> None:
    """Steps 1 to 7 of the module docstring, in that order: the keeper forks before anything that starts a
    thread or wraps Horovod."""
    from elastic_ext.launch import gloo_timeout, keeper, newcomer, notices, sigterm, torch_pages, torch_wait

    torch_pages.install()
    keeper.install()
    newcomer.install()
    newcomer.watch_dismissal()
    gloo_timeout.first_rendezvous_timeout()
    sigterm.install_early_sigterm()
    notices.install()
    torch_wait.install()


def main(argv: Optional[List[str]] = None) -> None:
    """Hands this worker's slot to the host's spare if there is one, else prepares it and runs its script.

    Raises:
        SystemExit: no script or module was named (exit code 2, with :data:`USAGE`).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    from elastic_ext.launch import keeper, spare

    if args[:1] == [spare.SPARE_FLAG]:  # the host's spare, started by an entry (spare.start)
        first = args[1:2] != [spare.NEXT_FLAG]
        raise SystemExit(spare.serve(args[-1], first, run) if len(args) == (2 if first else 3) else 2)
    if not args or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)

    module = args[0] == "-m"
    script = spare.script_path(args[1] if module else args[0], module)
    name = spare.address(script)
    if name is not None:
        ended = spare.hand_off(name, args)
        if ended is not None:
            keeper.end_as(ended)  # ends this process as the worker ended
        spare.start(os.path.abspath(script))  # for the next new worker on this host
    run(args)


def run(args: List[str]) -> None:
    """Prepares this worker (module docstring), then runs its script or module as ``__main__``."""
    module = args[0] == "-m"
    prepare()
    if module:
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

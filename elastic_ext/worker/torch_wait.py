"""Waiting for a Horovod PyTorch collective without keeping a core busy.

Every wait of Horovod 0.28.1's PyTorch binding for a collective
(``hvd.synchronize``, through which ``DistributedOptimizer``, the
broadcasts and ``broadcast_object`` go) ends in its extension's
``horovod_torch_wait_and_clear``: a loop that polls the handle and calls
``std::this_thread::yield()``, releasing and taking the GIL each time. A
waiting worker's main thread keeps a core busy, half of it in the kernel.
Where workers share cores (CPU training, more workers than cores, a host
whose cores the input pipeline also uses) those spinning threads take the
CPU from Horovod's background threads, which run the collective the main
threads wait for: the wait makes itself longer.

Under the launcher's worker entry each ``hvd.init()`` replaces that wait,
once the extension is loaded, with :func:`waiting`
(:func:`elastic_ext.worker.horovod_changes.install_worker`): it polls
the handle and sleeps between polls, 20 µs at first and doubling up to
:data:`MAX_PAUSE_S`, then lets Horovod's own wait release the handle (and
raise the collective's error, as before). A collective that is already done
costs one poll. The sleep releases the GIL, so the worker's other threads
(heartbeat, detectors) run meanwhile, and a signal handler runs while the
main thread waits instead of after the collective.

Measured on 2 cores (``python -m bench.engine``, docs/benchmarks.md): four
workers of bench.compare's job step in 57.9 ms with this wait against 72.8 ms
with Horovod's (1.26x), and half the CPU per step; two workers with no
compute, 3.36 against 4.16 ms.
"""

from __future__ import annotations

import time
from typing import Callable

FIRST_PAUSE_S = 20e-6
MAX_PAUSE_S = 5e-4
EXTENSION = "horovod.torch.mpi_lib_v2"
WAIT = "horovod_torch_wait_and_clear"
POLL = "horovod_torch_poll"


def waiting(poll: Callable[[int], int], wait_and_clear: Callable[[int], None],
            sleep: Callable[[float], None] = time.sleep) -> Callable[[int], None]:
    """A ``wait_and_clear(handle)`` that sleeps between ``poll(handle)`` calls until it is done,
    then calls the given ``wait_and_clear`` (which releases the handle and raises its error)."""

    def wait(handle: int) -> None:
        pause = FIRST_PAUSE_S
        while not poll(handle):
            sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
        wait_and_clear(handle)

    wait.elastic_ext_waits = wait_and_clear  # type: ignore[attr-defined]
    return wait


__all__ = ["EXTENSION", "FIRST_PAUSE_S", "MAX_PAUSE_S", "POLL", "WAIT", "waiting"]

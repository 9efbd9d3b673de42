"""One rank of bench/gloo_abort.py: fused allreduces of the digits MLP's gradients in a loop.

``loop OUT``: marks itself ready (``OUT/ready.<rank>.<pid>``), then allreduces
until a peer dies; prints the error and lives 1 s more, so that a native
abort of this process, if one follows, happens while it is still watched.
``rate``: prints how many of those rounds per second rank 0 sees over 500 rounds.
"""

import os
import sys
import time

import torch

import horovod.torch as hvd

SIZES = (64 * 64, 64, 64 * 10, 10)  # the 64-64-10 MLP's weight and bias gradients: one fused allreduce
RATE_WARMUP = 100
RATE_ROUNDS = 500


def allreduce_all(tensors):
    handles = [hvd.allreduce_async_(t, name=f"grad.{i}") for i, t in enumerate(tensors)]
    for handle in handles:
        hvd.synchronize(handle)


def main():
    hvd.init()
    tensors = [torch.randn(n) for n in SIZES]
    if sys.argv[1] == "rate":
        for _ in range(RATE_WARMUP):
            allreduce_all(tensors)
        started = time.perf_counter()
        for _ in range(RATE_ROUNDS):  # a count every rank knows: a per-rank clock would split the ranks
            allreduce_all(tensors)
        if hvd.rank() == 0:
            print(f"ROUNDS_PER_S {RATE_ROUNDS / (time.perf_counter() - started):.2f}", flush=True)
        return
    open(os.path.join(sys.argv[2], f"ready.{hvd.rank()}.{os.getpid()}"), "w").close()
    rounds = 0
    try:
        while True:
            allreduce_all(tensors)
            rounds += 1
    except Exception as exc:  # noqa: BLE001 - a peer died: what this rank saw is the output
        print(f"rank {hvd.rank()} after {rounds} rounds: {type(exc).__name__}", flush=True)
        time.sleep(1.0)
        os._exit(3)


if __name__ == "__main__":
    main()

"""Two ranks for test_collective_wait.py: rank 0 waits in an allreduce that rank 1 joins late.

Rank 0's helper thread waits until the main thread is inside Horovod's
allreduce, reads the main thread's CPU time over ``--window-s`` seconds of
that wait, then writes ``OUT/go``; rank 1 enters the allreduce once that
file exists. Each rank writes ``OUT/rank-R.json``: the allreduce's result,
whether the wait of Horovod's PyTorch extension is elastic_ext's, and on
rank 0 the fraction of the window its main thread ran on the CPU.
"""

import argparse
import json
import os
import threading
import time

import torch

import horovod.torch as hvd
from horovod.torch import mpi_lib_v2

from elastic_ext.worker.torch_wait import WAIT
from elastic_ext.runtime.activity import thread_cpu_s
from elastic_ext.runtime.watchdog import main_thread_waits

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--window-s", type=float, default=1.0)
args = p.parse_args()
go = os.path.join(args.out, "go")
report = {}


def measure_the_wait():
    while not main_thread_waits():
        time.sleep(0.001)
    tid = threading.main_thread().native_id
    before, started = thread_cpu_s(os.getpid(), tid), time.monotonic()
    time.sleep(args.window_s)  # the measured window, not a synchronisation: rank 1 waits for the file
    report["main_thread_cpu_fraction"] = (thread_cpu_s(os.getpid(), tid) - before) / (time.monotonic() - started)
    with open(go + ".tmp", "w") as handle:
        handle.write("go")
    os.replace(go + ".tmp", go)


hvd.init()
report["wait_is_elastic_ext"] = getattr(getattr(mpi_lib_v2, WAIT), "elastic_ext_waits", None) is not None
if hvd.rank() == 0:
    helper = threading.Thread(target=measure_the_wait, daemon=True)
    helper.start()
else:
    while not os.path.exists(go):
        time.sleep(0.01)
report["sum"] = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).tolist()
if hvd.rank() == 0:
    helper.join()
with open(os.path.join(args.out, f"rank-{hvd.rank()}.json"), "w") as handle:
    json.dump(report, handle)

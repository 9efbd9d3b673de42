"""Benchmark worker: the same training loop under plain Horovod elastic
(``--system plain``: hvd.elastic.TorchState + @hvd.elastic.run) or
elastic_ext (``--system ext``: elastic_ext.State + @elastic_ext.run).

Rank 3 SIGKILLs itself after ``--kill-step`` steps on 4 workers; the job
finishes ``--steps-after`` steps later on the survivors (2 under
``horovodrun``, which blacklists the host, 3 under ``elastic-horovodrun``). Writes ``kills.jsonl`` (time of the kill) and
``steps-<pid>.jsonl`` (time, step, world size of each completed step) under
``--out``, and ``calls-<pid>.jsonl`` (start and end of each ``hvd.init`` and
``hvd.shutdown`` call). (One failure per job: Horovod 0.28.1 ends the whole job when a
host fails again after its blacklist cooldown, with either system.)

The end of training is in the State (``ended``): when the killed slot's new
worker is on its way as the survivors finish, elastic_ext takes it in first
and calls the function again on every rank, from the commit of that end,
where it must return at once (a local "steps since the kill" alone kept
the job training at 4 workers until the benchmark's timeout).
"""

import argparse
import json
import os
import signal
import time

import torch

import horovod.torch as hvd

from bench.models import mlp

p = argparse.ArgumentParser()
p.add_argument("--system", choices=["plain", "ext"], required=True)
p.add_argument("--out", required=True)
p.add_argument("--kill-step", type=int, default=10)
p.add_argument("--steps-after", type=int, default=6)
p.add_argument("--step-sleep-s", type=float, default=0.05)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--model", choices=["mlp", "cnn_bn", "big", "table"], default="mlp",
               help="cnn_bn: a small CNN with BatchNorm2d, whose running statistics differ between ranks; "
                    "table: the mlp and a 432 MB table in the State, one slice of it updated per step")
args = p.parse_args()
TABLE_ELEMENTS = 108_000_000
TABLE_SLICE = 1_000_000  # elements updated in place per step

torch.set_num_threads(1)
calls = open(os.path.join(args.out, f"calls-{os.getpid()}.jsonl"), "a", buffering=1)


def timed(name):
    """hvd.<name>, with each call's start and end appended to calls-<pid>.jsonl: elastic_ext's reset calls
    hvd.shutdown() then hvd.init() (the rendezvous with the driver's new round and the Gloo context), and
    bench.recovery splits the reset's time between them."""
    original = getattr(hvd, name)

    def call(*a, **k):
        started = time.time()
        try:
            return original(*a, **k)
        finally:
            calls.write(json.dumps({"call": name, "start": started, "end": time.time(), "pid": os.getpid()}) + "\n")
    setattr(hvd, name, call)


timed("init")
timed("shutdown")
hvd.init()
table = None
if args.model in ("mlp", "table"):
    model = mlp([64, 256, 10])
    shape = (32, 64)
elif args.model == "big":  # 36.1M parameters: 432 MB with Adam's two moments
    model = mlp([64, 6000, 6000, 10])
    shape = (32, 64)
else:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10))
    shape = (32, 1, 8, 8)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
if args.model == "table":  # 108M float32: 432 MB the survivors must restore, the step stays the mlp's
    table = torch.zeros(TABLE_ELEMENTS)
log = open(os.path.join(args.out, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)
kills_path = os.path.join(args.out, "kills.jsonl")

if args.system == "plain":
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, ended=0,
                                   **({} if table is None else {"table": table}))
    run = hvd.elastic.run
else:
    import elastic_ext
    state = elastic_ext.State(model=model, optimizer=optimizer, step=0, ended=0,
                              **({} if table is None else {"table": table}))
    run = elastic_ext.run


@run
def train(state):
    killed_at = None
    while not state.ended:
        x = torch.randn(*shape)  # a different batch on every rank: BatchNorm statistics differ
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for i, param in enumerate(model.parameters()):
            hvd.allreduce_(param.grad, op=hvd.Average, name=f"g{i}")
        optimizer.step()
        if table is not None:
            start = (state.step * TABLE_SLICE) % TABLE_ELEMENTS
            table[start:start + TABLE_SLICE].add_(1.0)
        state.step += 1
        log.write(json.dumps({"t": time.time(), "step": state.step, "size": hvd.size(), "rank": hvd.rank()}) + "\n")
        time.sleep(args.step_sleep_s)
        if hvd.size() == 4 and hvd.rank() == 3 and state.step == args.kill_step:
            with open(kills_path, "a") as handle:
                handle.write(json.dumps({"t": time.time(), "step": state.step}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() < 4:
            killed_at = state.step if killed_at is None else killed_at
            if state.step - killed_at >= args.steps_after:
                state.ended = 1
                return
        if state.step % args.commit_every == 0:
            state.commit()


train(state)

"""Benchmark worker of ``bench.control_plane --validate``: a real job's phases, for the simulation to match.

Trains a small MLP under ``elastic_ext`` on ``--np`` workers; rank 3 of the
first round SIGKILLs itself after ``--kill-step`` steps (steady training
before it), the survivors go on, the killed slot's new worker joins by an
early start, and the job ends ``--steps-full`` steps after it is back at
``--np``. Writes under ``--out``: ``kills.jsonl`` (time of the kill) and
``calls-<pid>.jsonl`` (start and end of each ``hvd.init``).
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
p.add_argument("--out", required=True)
p.add_argument("--np", type=int, required=True)
p.add_argument("--kill-step", type=int, default=150)
p.add_argument("--steps-full", type=int, default=100)
p.add_argument("--step-sleep-s", type=float, default=0.05)
p.add_argument("--commit-every", type=int, default=4)
args = p.parse_args()
torch.set_num_threads(1)
calls = open(os.path.join(args.out, f"calls-{os.getpid()}.jsonl"), "a", buffering=1)
original_init = hvd.init


def init(*a, **k):
    started = time.time()
    try:
        return original_init(*a, **k)
    finally:
        calls.write(json.dumps({"call": "init", "start": started, "end": time.time(), "pid": os.getpid()}) + "\n")


hvd.init = init
hvd.init()
model = mlp([64, 256, 10])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

import elastic_ext  # noqa: E402

state = elastic_ext.State(model=model, optimizer=optimizer, step=0, ended=0, shrunk=0, full_steps=0)


@elastic_ext.run
def train(state):
    while not state.ended:
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for i, param in enumerate(model.parameters()):
            hvd.allreduce_(param.grad, op=hvd.Average, name=f"g{i}")
        optimizer.step()
        state.step += 1
        time.sleep(args.step_sleep_s)
        if hvd.size() == args.np and hvd.rank() == 3 and state.step == args.kill_step and not state.shrunk:
            with open(os.path.join(args.out, "kills.jsonl"), "a") as handle:
                handle.write(json.dumps({"t": time.time(), "step": state.step}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if hvd.size() < args.np:
            state.shrunk = 1
        elif state.shrunk:
            state.full_steps += 1
            if state.full_steps >= args.steps_full:
                state.ended = 1
                return
        if state.step % args.commit_every == 0:
            state.commit()


train(state)

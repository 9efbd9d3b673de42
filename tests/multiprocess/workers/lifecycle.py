"""Test worker for lifecycle cases: elastic PyTorch training on the UCI digits.

Like train_torch.py (ledger steps-<pid>.jsonl, final-<rank>.npz, events via
ELASTIC_EXT_EVENTS_PATH, checkpoints via ELASTIC_EXT_CHECKPOINT_*), plus:

--faults "RANK:STEP:HOW[:WHERE[:TARGET]]"  injected faults (devkit.faults), once each; a bit flip
                                   ("flip", WHERE step: before the step's forward, or before_commit)
                                   corrupts TARGET: param (the first layer's weight) or moment (its
                                   Adam exp_avg), on that rank only
--twice "RANK:STEP"                a LambdaLR scheduler in the State; from STEP on, RANK steps it twice
                                   per step (a deterministic divergence the replica check must stop on)
--phase "RANK:STEP:SECONDS"        at STEP, RANK spends SECONDS in ``state.phase("eval")``
--bare-phase                       the same time without opening a phase (the old behaviour)
--side "HOST:PORT"                 after hvd.init, open a TCP connection to an echo server and
                                   use it after training: side-<pid>.json says if it still works
--resize-at                        as in train_torch.py (devkit.faults.HostFileSchedule)
--stop-file PATH                   end after the first epoch at whose end PATH exists (all ranks agree)
--straggler "FACTOR:WINDOW:WARMUP"  StragglerPolicy(...), exclude file OUT/exclude
--compute-s S                      simulated compute per step (in state.step_timer): S seconds per 16 local samples
--newcomer-delay-s S               a process started after the job trained (a newcomer) sleeps S before hvd.init:
                                   a slow container start, a big import (it writes OUT/newcomer-<pid> first)
--newcomer-gate PATH               a newcomer writes OUT/newcomer-<pid>, then waits before hvd.init until PATH
                                   exists: a start that lasts until the test's event (fails after 280 s)
--guard                            State(guard=NumericGuard()) and state.guard_step after the allreduce; the
                                   guard's seconds per step go to guard-<pid>.json (median, count)
--guard-blocking                   the guard's allgather blocks each step, as before it ran in the background
--guard-blocks N                   with --guard, guard_step only where step // N is even (on and off in one job)
--slow "RANK:STEP:FACTOR[:STEPS]"  from STEP (for STEPS steps, default: to the end), the process that started
                                   as RANK computes FACTOR x longer (it stays slow under a new rank); several
                                   slowdowns are separated by commas
"""

import argparse
import json
import os
import socket
import time

import elastic_ext

import numpy as np
import torch
from examples.digits import load_digits

import horovod.torch as hvd

from devkit.ledger import Ledger
from elastic_ext.testing import heartbeat_period
from devkit.faults import CommitFaultProbe, FaultSchedule, HostFileSchedule
from elastic_ext.torch import ElasticSampler

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--sleep-below", type=int, default=0,
               help="SIZE: --step-sleep-s only while the world has fewer than SIZE workers (0: always)")
p.add_argument("--faults", default="")
p.add_argument("--phase", default="")
p.add_argument("--bare-phase", action="store_true")
p.add_argument("--side", default="")
p.add_argument("--resize-at", default="")
p.add_argument("--stop-file", default="")
p.add_argument("--fusion", action="store_true", help="one fused allreduce per step (grouped)")
p.add_argument("--straggler", default="")
p.add_argument("--compute-s", type=float, default=0.0)
p.add_argument("--slow", default="")
p.add_argument("--guard", action="store_true")
p.add_argument("--guard-blocking", action="store_true", help="the guard's allgather blocks each step (bench)")
p.add_argument("--guard-blocks", type=int, default=0,
               help="with --guard: guard_step only in steps whose step // N is even (the bench's A/B in one job)")
p.add_argument("--newcomer-delay-s", type=float, default=0.0)
p.add_argument("--newcomer-gate", default="")
p.add_argument("--heartbeat-period-s", type=float, default=0.0)
p.add_argument("--twice", default="")
args = p.parse_args()
if args.heartbeat_period_s:
    heartbeat_period(args.heartbeat_period_s)

torch.set_num_threads(1)
if (args.newcomer_delay_s or args.newcomer_gate) and any(
        name.startswith("steps-") and os.path.getsize(os.path.join(args.out, name)) for name in os.listdir(args.out)):
    open(os.path.join(args.out, f"newcomer-{os.getpid()}"), "w").close()  # imported, not yet in hvd.init()
    time.sleep(args.newcomer_delay_s)
    gate_deadline = time.monotonic() + 280
    while args.newcomer_gate and not os.path.exists(args.newcomer_gate):
        if time.monotonic() > gate_deadline:
            raise SystemExit(f"newcomer {os.getpid()}: {args.newcomer_gate} did not appear within 280 s")
        time.sleep(0.05)
hvd.init()
faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
first_rank = hvd.rank()  # --slow follows the process, not whoever holds its rank after a resize
resizes = HostFileSchedule(args.resize_at)

side = None
if args.side:
    host, port = args.side.rsplit(":", 1)
    side = socket.create_connection((host, int(port)), timeout=30)

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target, dtype=torch.int64)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.97 ** step) if args.twice else None
twice = tuple(int(x) for x in args.twice.split(":")) if args.twice else None
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=1, policy="pad")
book = Ledger(args.out)
commit_probe = CommitFaultProbe(faults, hvd.rank)


def long_phase(state):
    if not args.phase:
        return
    rank, step, seconds = args.phase.split(":")
    if hvd.rank() != int(rank) or state.step != int(step):
        return
    if args.bare_phase:
        time.sleep(float(seconds))
    else:
        with state.phase("eval"):
            time.sleep(float(seconds))


def compute_seconds(state):
    """Simulated compute of this step: --compute-s, times the --slow factor on the slow rank."""
    seconds = args.compute_s
    for spec in filter(None, args.slow.split(",")):
        parts = spec.split(":")
        rank, start, factor = int(parts[0]), int(parts[1]), float(parts[2])
        steps = int(parts[3]) if len(parts) > 3 else None
        if first_rank == rank and state.step >= start and (steps is None or state.step < start + steps):
            seconds *= factor
    return seconds


def train_step(state, indices, pad):
    keep = torch.tensor(~pad)
    rows = torch.from_numpy(indices.astype(np.int64))
    with state.step_timer:  # this rank's own compute, not the allreduce waits
        losses = torch.nn.functional.cross_entropy(model(X[rows]), Y[rows], reduction="none")
        loss = (losses * keep).sum() / args.global_batch  # the global mean whatever the world size
        optimizer.zero_grad()
        loss.backward()
        if args.compute_s:
            time.sleep(compute_seconds(state) * len(indices) / 16)
    grads = [q.grad for q in model.parameters()]
    if args.fusion:
        handle = hvd.grouped_allreduce_async_(grads, name="grads", op=hvd.Sum)
        faults.maybe_fire(hvd.rank(), state.step, where="allreduce")
        hvd.synchronize(handle)
    else:
        handles = [hvd.allreduce_async_(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        faults.maybe_fire(hvd.rank(), state.step, where="allreduce")  # a collective is in flight here
        for handle in handles:
            hvd.synchronize(handle)
    if args.guard and not (args.guard_blocks and (state.step // args.guard_blocks) % 2):
        started = time.perf_counter()
        state.guard_step(loss, grads, samples=int((~pad).sum()))
        guard_seconds.append(time.perf_counter() - started)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
        if hvd.rank() == twice[0] and state.step >= twice[1]:
            scheduler.step()


def flip_targets():
    """What a "flip" fault may corrupt: views of the live tensors (CPU tensors share their memory)."""
    weight = model[0].weight
    moment = optimizer.state.get(weight, {}).get("exp_avg")
    return {"param": weight.detach().numpy(), **({"moment": moment.numpy()} if moment is not None else {})}


def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in sampler.batches():
            faults.maybe_fire(hvd.rank(), state.step, where="step", targets=flip_targets())
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices[~pad], int(pad.sum()))
            long_phase(state)
            train_step(state, indices, pad)
            if args.step_sleep_s and (not args.sleep_below or hvd.size() < args.sleep_below):
                time.sleep(args.step_sleep_s)
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                commit_probe.step = state.step
                resizes.maybe_apply(state, hvd.rank(), state.step)
                faults.maybe_fire(hvd.rank(), state.step, where="before_commit", targets=flip_targets())
                state.commit()
                commit_probe.step = None
        state.epoch += 1
        if args.stop_file:
            stop = hvd.allreduce(torch.tensor([float(os.path.exists(args.stop_file))]), op=hvd.Max,
                                 name="stop_file")
            if stop.item() > 0:
                break
    state.commit()
    state.wait_for_checkpoint()


straggler = None
if args.straggler:
    factor, window, warmup = args.straggler.split(":")
    straggler = elastic_ext.StragglerPolicy(factor=float(factor), window_steps=int(window), warmup_steps=int(warmup))
guard_seconds = []
config = elastic_ext.ElasticConfig.from_env(exclude_file=os.path.join(args.out, "exclude") if straggler else None)
state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0, config=config,
                          commit_probe=commit_probe, adapters=[commit_probe], straggler=straggler,
                          guard=elastic_ext.NumericGuard() if args.guard else None,
                          **({"scheduler": scheduler} if scheduler is not None else {}))
if args.guard_blocking:
    state.binding.allgather_start = None  # no background allgather: the guard's collective blocks every step
elastic_ext.run(train)(state)

arrays = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
for pid, st in optimizer.state_dict()["state"].items():
    for k, v in st.items():
        arrays[f"opt/{pid}/{k}"] = v.numpy() if torch.is_tensor(v) else np.asarray(v)
np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **arrays)
with open(os.path.join(args.out, f"final-{hvd.rank()}.json"), "w") as handle:
    json.dump({"step": state.step, "size": hvd.size(), "epoch": sampler.epoch, "commit_id": state.commit_id},
              handle)
if side is not None:
    message = f"ping-{os.getpid()}\n".encode()
    try:
        side.sendall(message)
        echoed = b""
        while not echoed.endswith(b"\n"):
            chunk = side.recv(4096)
            if not chunk:
                break
            echoed += chunk
        result = {"ok": echoed == message, "echoed": echoed.decode(errors="replace")}
    except OSError as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(args.out, f"side-{os.getpid()}.json"), "w") as handle:
        json.dump({"rank": hvd.rank(), **result}, handle)
book.end(state.step, hvd.rank(), hvd.size())
if args.guard and guard_seconds:
    with open(os.path.join(args.out, f"guard-{os.getpid()}.json"), "w") as handle:
        json.dump({"rank": hvd.rank(), "median_s": float(np.median(guard_seconds)), "count": len(guard_seconds)},
                  handle)

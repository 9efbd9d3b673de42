"""bench.recovery worker, torchft: recovery_worker.py's loop in one replica group of four.

The setup of bench/workers/compare_torchft.py (a torchrun agent per group,
the Lighthouse of bench/peer_torchft.py, ``Manager`` + ``torchft.Optimizer`` +
``ProcessGroupGloo``, the gradients through ``Manager.allreduce``). Group 3
SIGKILLs itself after ``--kill-step`` committed steps at 4 groups (its first
process only); its agent starts it again and it heals from a peer. Each
committed step appends ``{"t", "step", "size", "rank"}`` to
``steps-<pid>.jsonl`` (``size``: the groups taking part); the job ends at
the first commit after the driver wrote ``<out>/stop``.
"""

import argparse
import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch

from bench.models import mlp
from bench.workers.compare_common import manager_allreduce

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--kill-step", type=int, default=10)
p.add_argument("--step-sleep-s", type=float, default=0.05)
p.add_argument("--model", choices=["mlp", "big"], default="mlp")
args = p.parse_args()
logging.basicConfig(level=logging.INFO)

from torchft import Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402

GROUP = int(os.environ["REPLICA_GROUP_ID"])
torch.set_num_threads(1)
model = mlp([64, 256, 10]) if args.model == "mlp" else mlp([64, 6000, 6000, 10])
inner = torch.optim.Adam(model.parameters(), lr=1e-3)
kills_path = os.path.join(args.out, "kills.jsonl")
first_process = not os.path.exists(kills_path)
pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
manager = Manager(pg=pg, min_replica_size=1, replica_id=f"recovery_{GROUP}", timeout=timedelta(seconds=60),
                  load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
                  state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
                  checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=torch.device("cpu")))
optimizer = Optimizer(manager, inner)
log = open(os.path.join(args.out, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)

while not os.path.exists(os.path.join(args.out, "stop")):
    optimizer.zero_grad()
    model(torch.randn(32, 64)).pow(2).mean().backward()
    manager_allreduce(manager, model)
    before = manager.current_step()
    optimizer.step()
    if manager.current_step() > before:
        log.write(json.dumps({"t": time.time(), "step": manager.current_step(), "size": manager.num_participants(),
                              "rank": GROUP}) + "\n")
    time.sleep(args.step_sleep_s)
    if first_process and GROUP == 3 and manager.num_participants() == 4 and manager.current_step() >= args.kill_step:
        with open(kills_path, "a") as handle:
            handle.write(json.dumps({"t": time.time(), "step": manager.current_step()}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)
manager.shutdown(wait=False)

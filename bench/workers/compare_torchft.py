"""bench.compare worker, torchft: one replica group of one worker (Manager, DDP, Optimizer wrapper, Gloo).

Set up as torchft's own ``train_ddp.py`` and ``torchx.py`` do: each replica
group is a ``torchrun --nnodes 1 --nproc-per-node 1 --max-restarts N`` (its
agent holds the group's TCPStore, which the Manager joins as a client; a
killed worker is started again by its agent), ``REPLICA_GROUP_ID`` and
``NUM_REPLICA_GROUPS`` in the environment, the Lighthouse's address in
``TORCHFT_LIGHTHOUSE``. ``ProcessGroupGloo(timeout=5 s)``,
``Manager(min_replica_size=1, timeout=30 s, checkpoint_transport=PGTransport)``,
``torchft.DistributedDataParallel`` and ``torchft.Optimizer``, and torchft's
``DistributedSampler`` sharding the data by replica group. A restarted group
heals: its first quorum sees it behind, and it receives the live state
(model, optimizer, step) of a peer.

What differs from that example, and why:
- the data position of the group (epoch, batches done) is saved after every
  step to ``<out>/torchft-data-<group>.json`` and loaded at start, as the
  example's comments advise ("checkpoint dataloader frequently (every step?)
  to avoid repeated batches");
- by default the gradients go through ``Manager.allreduce`` (one flat buffer,
  as DDP's one bucket for this model, waited for before ``optimizer.step()``)
  instead of ``torchft.DistributedDataParallel``. With ``--ddp`` (the example as
  written) a peer killed during the allreduce makes Gloo's ``wait()`` raise;
  ``_ManagedWork.wait`` records the error but leaves the future unset, and
  torchft 0.2.0's DDP comm hook then fails ``assert fut._fut``: the exception
  leaves ``loss.backward()`` and the survivor dies. Caught, the next forward
  fails in DDP's reducer (``!unmarked_param_indices.empty()`` INTERNAL ASSERT),
  so every survivor dies, and the groups their agents restart start over at
  step 0 with the initial model (no live state is left to heal from).

Step log: the ledger records of compare_common.StepLog plus what the commit
of a step is decided by here: the generation is the quorum id; a *step*
record (before the allreduce) carries ``part`` (whether this group's
gradients count: a healing group contributes zeros); after ``should_commit``
an *outcome* record ``{"outcome": step, "g": quorum, "committed", "part",
"rank"}``; a *done* record only for committed steps (``size``: the groups
taking part). bench/peer_torchft.py reads them.
"""

import itertools
import json
import logging
import os
import time
from datetime import timedelta

import torch

from bench.workers import compare_common as common

GROUP = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ["NUM_REPLICA_GROUPS"])

p = common.parser(__doc__.splitlines()[0])
p.add_argument("--ddp", action="store_true", help="torchft.DistributedDataParallel, as train_ddp.py (see above)")
p.add_argument("--log-level", default="INFO", help="torchft's logging level (its example: INFO)")
args = p.parse_args()
logging.basicConfig(level=args.log_level)

from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402

x, y, model, inner = common.start(args, lambda: None)
log = common.StepLog(args.out, "torchft")
position_path = os.path.join(args.out, f"torchft-data-{GROUP}.json")


def load_state_dict(state):
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


def state_dict():
    return {"model": model.state_dict(), "optim": inner.state_dict()}


pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                  replica_id=f"compare_{GROUP}", timeout=timedelta(seconds=30),
                  checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
ddp = DistributedDataParallel(manager, model) if args.ddp else model
optimizer = Optimizer(manager, inner)
per_group = args.global_batch // GROUPS
sampler = DistributedSampler(range(common.DATASET_SIZE), replica_rank=GROUP, num_replica_groups=GROUPS,
                             group_rank=0, num_replicas=1, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(range(common.DATASET_SIZE), batch_size=per_group, sampler=sampler)



epoch, batch = 0, 0
if os.path.exists(position_path):
    with open(position_path, encoding="utf-8") as handle:
        saved = json.load(handle)
    epoch, batch = saved["epoch"], saved["batch"]


def save_position():
    with open(position_path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump({"epoch": epoch, "batch": batch}, handle)
    os.replace(position_path + ".tmp", position_path)


quorum = None
finished = False
while epoch < args.max_epochs and not finished:
    sampler.set_epoch(epoch)
    steps_in_epoch = len(loader)
    for index in itertools.islice(loader, batch, None):
        optimizer.zero_grad()  # starts the quorum (asynchronously)
        loss = common.local_loss(ddp, x, y, index, torch.ones(len(index)), args.global_batch) * GROUPS
        common.compute(args.compute_ms_per_sample, len(index))
        participating = manager.participating_rank() is not None and manager.is_participating()
        step = manager.current_step()  # after the quorum: a healing group has the step of its peers now
        if manager._quorum_id != quorum:  # a new quorum: a generation of this log
            quorum = manager._quorum_id
            log.start(quorum, epoch, batch * per_group, step, GROUP, manager.num_participants())
        record = {"gen": quorum, "part": participating, "epoch": epoch, "cursor": batch * per_group,
                  "step": step, "rank": GROUP, "size": manager.num_participants(),
                  "indices": [int(i) for i in index], "pads": 0, "t": time.time()}
        log._write(record)
        loss.backward()  # with --ddp, its comm hook runs the Manager's allreduce
        if not args.ddp:
            common.manager_allreduce(manager, model)
        started = time.perf_counter()
        optimizer.step()  # should_commit, then the optimizer's step if it agreed
        committed = manager.current_step() > step
        batch += 1
        end_of_epoch = batch == steps_in_epoch
        if end_of_epoch:
            epoch, batch = epoch + 1, 0
        save_position()
        log._write({"outcome": step, "g": quorum, "committed": committed, "part": participating, "rank": GROUP,
                    "t": time.time()})
        if committed:
            log.done(quorum, step, GROUP, manager.num_participants(), len(index) if participating else 0)
            log.commit(step, GROUP, time.perf_counter() - started)
            # Every committed step reads the stop step: a group that healed may have jumped over a
            # commit step, and the driver writes the stop step several commits ahead.
            stop = log.stop_step()
            if stop is not None and manager.current_step() >= stop:
                finished = True
                break
manager.shutdown(wait=False)

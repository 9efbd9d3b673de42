"""bench.compare worker, torchrun: DDP over Gloo, restart from the last checkpoint.

What a torch user writes for ``torchrun --max-restarts``: every restart runs
this script from the top on every worker; it loads the newest checkpoint if
there is one, and rank 0 saves one every ``--commit-every`` steps and at the
end of each epoch (``torch.save`` to a temporary file, then ``os.replace``,
so a restart never reads a half-written file; no fsync, as is usual). The
data position is (epoch, step in epoch): a ``DistributedSampler`` with
``set_epoch`` and the batches done this epoch skipped on resume, which is
exact while the world size is the one the checkpoint was written with.
"""

import itertools
import os
import time

import torch
import torch.distributed as dist

from bench.workers import compare_common as common

p = common.parser(__doc__.splitlines()[0])
p.add_argument("--checkpoint", required=True, help="the checkpoint file, loaded at start if it exists")
args = p.parse_args()
x, y, model, optimizer = common.start(args, lambda: dist.init_process_group("gloo"))
rank, size = dist.get_rank(), dist.get_world_size()
ddp = torch.nn.parallel.DistributedDataParallel(model)
batch = args.global_batch // size
sampler = torch.utils.data.distributed.DistributedSampler(range(common.DATASET_SIZE), shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(range(common.DATASET_SIZE), batch_size=batch, sampler=sampler)
log = common.StepLog(args.out, "torchrun")
path = args.checkpoint

epoch, step, step_in_epoch = 0, 0, 0
if os.path.exists(path):
    saved = torch.load(path, map_location="cpu")
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    epoch, step, step_in_epoch = saved["epoch"], saved["step"], saved["step_in_epoch"]


def save():
    if rank != 0:
        return
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
                "step_in_epoch": step_in_epoch}, path + ".tmp")
    os.replace(path + ".tmp", path)


# A generation id that every rank of this incarnation agrees on.
gen = [time.time_ns()]
dist.broadcast_object_list(gen, src=0)
gen = gen[0]
log.start(gen, epoch, step_in_epoch * args.global_batch, step, rank, size)
# A restart after the job reached its stop step (a worker that crashed on its way out) has nothing to do.
stop = log.stop_step()
finished = stop is not None and step >= stop
while epoch < args.max_epochs and not finished:
    sampler.set_epoch(epoch)
    steps_in_epoch = len(loader)
    for index in itertools.islice(loader, step_in_epoch, None):
        cursor = step_in_epoch * args.global_batch
        real = torch.ones(len(index))
        # DDP averages gradients over the world; x size makes it the global mean, as with Horovod's Sum.
        loss = common.local_loss(ddp, x, y, index, real, args.global_batch) * size
        optimizer.zero_grad()
        common.compute(args.compute_ms_per_sample, len(index))
        log.step(gen, epoch, cursor, step, rank, size, index.tolist())
        loss.backward()  # DDP's allreduce runs here
        optimizer.step()
        step += 1
        step_in_epoch += 1
        log.done(gen, step - 1, rank, size, len(index))
        end_of_epoch = step_in_epoch == steps_in_epoch
        if end_of_epoch:
            epoch, step_in_epoch = epoch + 1, 0
        if (end_of_epoch or step % args.commit_every == 0) and log.commit_point(save, step, rank):
            finished = True
            break
dist.barrier()  # nobody tears down its process group while a peer still uses it
dist.destroy_process_group()

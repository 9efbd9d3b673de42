"""Test worker: the model zoo, elastic training of models users actually train,
on the UCI digits (8x8 images).

--model picks one:
  torch        a Conv2d + BatchNorm2d + dropout branch beside a small Transformer
               encoder (LayerNorm, dropout), AdamW, OneCycleLR, GradScaler
               (disabled on CPU, tracked all the same), the global RNG tracked
  keras3       TF with Keras 3: Conv2D + BatchNormalization + Dropout, SGD with
               momentum, the training step inside @tf.function
  keras2       the same with Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1)

Every model holds state that legitimately differs between ranks (BatchNorm
running statistics, dropout RNG streams) next to state that must agree. The
State also tracks a per-rank metric (``per_rank=("metric",)``).

Writes under --out: the sample ledger (steps-<pid>.jsonl), synced-<pid>.jsonl
(right after every sync: CRCs of this rank's parameters and of its buffers),
final-<rank>.npz (parameters and optimizer state at the end), and events
(ELASTIC_EXT_EVENTS_PATH). Faults and resizes as in train_torch.py.
"""

import argparse
import json
import os
import threading
import time
import zlib

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--model", choices=["torch", "keras3", "keras2"], required=True)
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--faults", default="")
p.add_argument("--resize-at", default="")
p.add_argument("--busy", default="", help="RANK:STEP:SECONDS: that rank works SECONDS outside any collective "
                                          "before the step, marking progress, while the others wait")
args = p.parse_args()
TF = args.model.startswith("keras")
if args.model == "keras2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
from examples.digits import load_digits  # noqa: E402

import elastic_ext  # noqa: E402
from elastic_ext import liveness  # noqa: E402
from devkit.ledger import Ledger  # noqa: E402
from devkit.faults import CommitFaultProbe, FaultSchedule, HostFileSchedule  # noqa: E402

digits = load_digits()
IMAGES = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8)
LABELS = digits.target.astype(np.int64)
book = Ledger(args.out)


def crc(arrays):
    value = 0
    for array in arrays:
        value = zlib.crc32(np.ascontiguousarray(array).view(np.uint8).data, value)
    return value


def busy_wait(rank, step):
    """A rank busy outside any collective (an evaluation, a validation): progress marked."""
    if not args.busy:
        return
    who, at, seconds = args.busy.split(":")
    marker = os.path.join(args.out, f"busy-{at}")
    if rank != int(who) or step != int(at) or os.path.exists(marker):
        return
    open(marker, "w").close()
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        liveness.progress()


def marking_progress(fn, *fn_args):
    """Runs test machinery (waiting for the driver to see a rewritten host
    file) without it counting as a stalled step."""
    done = threading.Event()

    def beat():
        while not done.wait(0.2):
            liveness.progress()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        fn(*fn_args)
    finally:
        done.set()
        thread.join()


# ------------------------------------------------------------------ torch

def torch_job():
    import torch

    import horovod.torch as hvd
    from elastic_ext.torch import ElasticSampler

    torch.set_num_threads(1)
    hvd.init()
    X = torch.from_numpy(IMAGES).unsqueeze(1)
    Y = torch.from_numpy(LABELS)
    torch.manual_seed(0)
    nn = torch.nn
    sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=1, policy="pad")
    total_steps = args.epochs * -(-len(X) // args.global_batch) + 1  # steps of the pad policy, whatever the size

    class Hybrid(nn.Module):
        """A BatchNorm CNN and a small Transformer encoder (the image's rows as 8 tokens) side by side."""

        def __init__(self):
            super().__init__()
            self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Dropout(0.2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
            self.embed = nn.Linear(8, 16)
            self.position = nn.Parameter(torch.zeros(1, 8, 16))
            layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            tokens = self.embed(x.view(x.shape[0], 8, 8)) + self.position
            return self.cnn(x) + self.head(self.norm(self.encoder(tokens)).mean(dim=1))

    model = Hybrid()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=total_steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    torch.manual_seed(1000 + hvd.rank())  # dropout: a stream per rank, as without elastic
    faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
    resizes = HostFileSchedule(args.resize_at)
    probe = CommitFaultProbe(faults, hvd.rank)
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                              rng=elastic_ext.GlobalRNG(), metric=np.zeros(2), per_rank=("metric",),
                              commit_probe=probe, adapters=[probe], scheduler=scheduler, scaler=scaler)
    buffers = {name for name, _ in model.named_buffers()}

    def synced_record(state):
        params = [v.numpy() for k, v in model.state_dict().items() if k not in buffers]
        bufs = [v.numpy() for k, v in model.state_dict().items() if k in buffers]
        return {"params": crc(params), "buffers": crc(bufs), "n_buffers": len(bufs)}

    def step_fn(state, indices, pad):
        model.train()
        index = torch.from_numpy(indices.astype(np.int64))
        keep = torch.from_numpy(~pad).float()
        losses = torch.nn.functional.cross_entropy(model(X[index]), Y[index], reduction="none")
        loss = (losses * keep).sum() / args.global_batch
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        handles = [hvd.allreduce_async_(q.grad, name=f"grad.{i}", op=hvd.Sum)
                   for i, q in enumerate(model.parameters())]
        faults.maybe_fire(hvd.rank(), state.step, where="allreduce")
        for handle in handles:
            hvd.synchronize(handle)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        state.metric += [float(loss.detach()), 1.0]

    def finals():
        arrays = {f"model/{k}": v.numpy() for k, v in model.state_dict().items() if k not in buffers}
        for pid, st in optimizer.state_dict()["state"].items():
            for k, v in st.items():
                arrays[f"opt/{pid}/{k}"] = v.numpy() if torch.is_tensor(v) else np.asarray(v)
        arrays["lr"] = np.asarray(scheduler.get_last_lr())
        return arrays

    loop(state, hvd, sampler, lambda s: sampler.batches(), step_fn, synced_record, finals, faults, resizes, probe)


# ------------------------------------------------------------- tensorflow

def tf_job():
    import tensorflow as tf

    if args.model == "keras2":
        import tf_keras as keras
    else:
        import keras

    import horovod.tensorflow as hvd
    from elastic_ext.tensorflow import ElasticSampler, index_dataset

    assert keras.__version__.startswith(args.model[-1]), keras.__version__
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    X = tf.constant(IMAGES[..., None])
    Y = tf.constant(LABELS)
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((8, 8, 1)), L.Conv2D(8, 3, padding="same"), L.BatchNormalization(),
                              L.ReLU(), L.MaxPooling2D(), L.Dropout(0.2), L.Flatten(), L.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    tf.random.set_seed(1000 + hvd.rank())
    sampler = ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
    faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
    resizes = HostFileSchedule(args.resize_at)
    probe = CommitFaultProbe(faults, hvd.rank)
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                              metric=np.zeros(2), per_rank=("metric",), commit_probe=probe, adapters=[probe])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool)])
    def train_step(indices, pad):
        # The whole step, allreduce included, runs as graph code: a rank
        # waiting here for a slow peer is not in any Python frame of Horovod.
        keep = tf.cast(tf.logical_not(pad), tf.float32)
        x, y = tf.gather(X, indices), tf.gather(Y, indices)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y, model(x, training=True)) * keep) / args.global_batch
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [hvd.allreduce(g, op=hvd.Sum, name=f"grad_{i}") for i, g in enumerate(grads)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    trainable = {id(v) for v in model.trainable_variables}

    def synced_record(state):
        params = [np.asarray(v.numpy()) for v in model.variables if id(v) in trainable]
        bufs = [np.asarray(v.numpy()) for v in model.variables if id(v) not in trainable]
        return {"params": crc(params), "buffers": crc(bufs), "n_buffers": len(bufs)}

    def step_fn(state, indices, pad):
        faults.maybe_fire(hvd.rank(), state.step, where="allreduce")
        loss = train_step(tf.cast(indices, tf.int64), pad)
        state.metric += [float(loss), 1.0]

    def finals():
        arrays = {f"model/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)
                  if id(v) in trainable}
        opt_vars = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
        arrays.update({f"opt/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(opt_vars)})
        return arrays

    def batches(sampler):
        for indices, pad in index_dataset(sampler):
            yield indices.numpy(), pad.numpy()

    loop(state, hvd, sampler, batches, step_fn, synced_record, finals, faults, resizes, probe)


# ------------------------------------------------------------------ shared

def loop(state, hvd, sampler, batches, step_fn, synced_record, finals, faults, resizes, probe):
    synced_path = os.path.join(args.out, f"synced-{os.getpid()}.jsonl")

    @elastic_ext.run
    def train(state):
        with open(synced_path, "a") as handle:
            handle.write(json.dumps({"gen": state.generation, "rank": hvd.rank(), "size": hvd.size(),
                                     "commit_id": state.commit_id, **synced_record(state)}) + "\n")
        book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            for indices, pad in batches(sampler):
                faults.maybe_fire(hvd.rank(), state.step, where="step")
                busy_wait(hvd.rank(), state.step)
                book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                          indices[~pad], int(pad.sum()))
                step_fn(state, indices, pad)
                sampler.record_step()
                state.step += 1
                if state.step % args.commit_every == 0:
                    probe.step = state.step
                    marking_progress(resizes.maybe_apply, state, hvd.rank(), state.step)
                    state.commit()
                    probe.step = None
            state.epoch += 1
        state.commit()

    train(state)
    np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **finals())
    with open(os.path.join(args.out, f"metric-{hvd.rank()}.json"), "w") as handle:
        json.dump({"metric": state.metric.tolist(), "step": state.step, "size": hvd.size()}, handle)
    book.end(state.step, hvd.rank(), hvd.size())


if TF:
    tf_job()
else:
    torch_job()

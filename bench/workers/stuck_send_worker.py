"""Benchmark worker for bench.stuck_send: a Keras 3 model of 4.2M parameters (16.8 MB of gradients per step)
trained by elastic_ext under ``elastic-horovodrun``, its gradients averaged inside ``tf.function`` by elastic_ext's
``DistributedGradientTape``, so every step's ring allreduce sends segments larger than a socket buffer.

Writes ``steps-<pid>.jsonl`` (time, step, world size of each completed step) under ``--out``; ends
``--steps`` steps in. bench.stuck_send SIGKILLs a worker mid-training. ``--no-watch`` sets
elastic_ext's closed-links watch (elastic_ext.runtime.closed_links) out of reach, the baseline.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf

import keras

import horovod.tensorflow as hvd

import elastic_ext
from elastic_ext.runtime import closed_links
from elastic_ext.tensorflow import DistributedGradientTape

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=400)
p.add_argument("--commit-every", type=int, default=10)
p.add_argument("--no-watch", action="store_true")
args = p.parse_args()

if args.no_watch:
    closed_links.STUCK_S = float("inf")
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(2048), keras.layers.Dense(1024)])
optimizer = keras.optimizers.SGD(1e-4)
x = tf.constant(np.random.default_rng(hvd.rank()).standard_normal((8, 1024)), dtype=tf.float32)
log = open(os.path.join(args.out, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    grads = DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


@elastic_ext.run
def train(state):
    while state.step < args.steps:
        train_step()
        state.step += 1
        log.write(json.dumps({"t": time.time(), "step": state.step, "size": hvd.size()}) + "\n")
        if state.step % args.commit_every == 0:
            state.commit()


train(elastic_ext.State(model=model, optimizer=optimizer, step=0))

"""Smoke worker: torch and TensorFlow allreduce through Horovod; prints one JSON line per rank."""

import json
import sys

framework = sys.argv[1]
if framework == "torch":
    import torch
    import horovod.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1), 10.0]), op=hvd.Sum).tolist()
    gathered = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
else:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank() + 1), 10.0]), op=hvd.Sum).numpy().tolist()
    gathered = hvd.allgather(tf.constant([hvd.rank()])).numpy().tolist()
print(json.dumps({"framework": framework, "rank": hvd.rank(), "size": hvd.size(), "sum": total,
                  "gathered": gathered}), flush=True)

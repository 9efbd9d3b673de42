"""bench.kill_close's worker: holds a tensor and its commit buffer, as a worker with a large State does.

Allocates a float32 torch tensor of the size given (MB), writes it, commits
it into a buffer as the State does (``elastic_ext.state.buffers.aligned_empty``
and ``elastic_ext.state.written.copy``, so it is watched for writes), writes
one slice as a step would, then connects to the port given, sends its pid
and the MB of its memory in huge pages, and waits to be killed.
"""

import os
import socket
import sys
import time

import numpy as np
import torch

from elastic_ext.state import buffers, written

port, megabytes = int(sys.argv[1]), int(sys.argv[2])
tensor = torch.zeros(megabytes * 250_000)
tensor.add_(1.0)
buffer = buffers.aligned_empty(tuple(tensor.shape), np.float32)
written.copy(tensor.data_ptr(), tensor.numel() * 4, buffer, to_buffer=True)
tensor[:1_000_000].add_(1.0)  # a step after the commit
with open("/proc/self/smaps_rollup", encoding="ascii") as smaps:
    huge_mb = int(smaps.read().split("AnonHugePages:")[1].split()[0]) // 1024
link = socket.create_connection(("127.0.0.1", port))
link.sendall(f"{os.getpid()} {huge_mb}".encode())
while True:
    time.sleep(60)

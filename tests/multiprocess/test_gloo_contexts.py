"""The Gloo contexts ``hvd.init()`` builds through the rendezvous store, with Horovod built by tools/setup.sh.

Two real Horovod processes (PyTorch, Gloo controller and operations, one
per pseudo-host) meet through Horovod's own rendezvous server, run here
with its handler counting every request by scope, as ``gloo_run`` starts
them. Horovod 0.28.1 as released builds the global, local and cross
contexts, then three more for the global process set (the same ranks);
with patch 09 the global process set shares the first three, and a process
set the user adds still builds its own. Each collective's result is
checked, on both process sets.
"""

import subprocess
import sys

from horovod.runner.http.http_server import RendezvousHandler, RendezvousServer

from elastic_ext.control import horovod_seam
from tests.multiprocess import launch

PATCH = "09-global-process-set-shares-global-contexts"

WORKER = r"""
import sys
import torch
import horovod.torch as hvd

torch.set_num_threads(1)
user_set = hvd.ProcessSet([1])
hvd.init(process_sets=[user_set])
if hvd.rank() == 1:
    mine = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum, name="user_sum", process_set=user_set)
    assert mine.item() == 5.0, f"rank 1: sum over its own process set {mine.item()}, expected 5.0"
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="global_sum")  # after rank 1's
assert total.item() == 3.0, f"rank {hvd.rank()}: global sum {total.item()}, expected 3.0"
hvd.shutdown()
print("ok", sys.argv[1], flush=True)
"""


def counting_handler(seen):
    class Counting(RendezvousHandler):
        def do_PUT(self):
            seen.append(self.path.split("/")[1])
            super().do_PUT()

        def do_GET(self):
            seen.append(self.path.split("/")[1])
            super().do_GET()

    return Counting


def test_the_global_process_set_shares_the_global_contexts_and_an_added_set_builds_its_own(tmp_path):
    assert PATCH in horovod_seam.build_patches(), \
        f"this Horovod was not built with {PATCH} (tools/setup.sh builds it): {horovod_seam.build_patches()}"
    seen = []
    server = RendezvousServer()
    port = server.start(handler_cls=counting_handler(seen))
    procs = []
    try:
        for rank, host in enumerate(("host-a", "host-b")):
            env = launch.base_env(
                HOROVOD_RANK=rank, HOROVOD_SIZE=2, HOROVOD_LOCAL_RANK=0, HOROVOD_LOCAL_SIZE=1,
                HOROVOD_CROSS_RANK=rank, HOROVOD_CROSS_SIZE=2, HOROVOD_HOSTNAME=host,
                HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=port,
                HOROVOD_GLOO_IFACE="lo", HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                HOROVOD_GLOO_TIMEOUT_SECONDS=60)
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, "-c", WORKER, str(rank)], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, cwd=str(tmp_path)), log))
        codes = [proc.wait(timeout=120) for proc, _ in procs]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        server.stop()
    outputs = [open(tmp_path / f"rank{rank}.log").read() for rank in range(2)]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n".join(o[-2000:] for o in outputs)
    scopes = set(seen)
    plain = {scope for scope in scopes if "_process_set_hash_" not in scope}
    assert plain == {"global", "local_host-a", "local_host-b", "cross_0"}, f"scopes {sorted(scopes)}"
    # One process set built its own contexts: the user's (rank 1 only: global, local, cross of size 1).
    hashes = {scope.split("_process_set_hash_")[1] for scope in scopes - plain}
    assert len(hashes) == 1, f"process sets that built contexts: {sorted(hashes)} (scopes {sorted(scopes)})"
    (suffix,) = hashes
    assert scopes - plain == {f"global_process_set_hash_{suffix}", f"local_host-b_process_set_hash_{suffix}",
                              f"cross_0_process_set_hash_{suffix}"}, f"scopes {sorted(scopes)}"

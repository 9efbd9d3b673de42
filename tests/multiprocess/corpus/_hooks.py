"""What the corpus scripts share that a user's script would not have: the test's hooks.

Every corpus script is a user's training script with three modes:

- elastic (the default): ``elastic_ext.State`` and ``@elastic_ext.run`` under
  ``elastic-horovodrun``;
- ``--reference``: one process, no Horovod, the whole global batch per step,
  the same seed and steps: the math the user means;
- ``--plain``: Horovod's own ``hvd.elastic`` state and run under plain
  ``horovodrun``, without elastic_ext's State or run.

This module gives them what only the test needs: the common command line, the digits, the
fault schedule and resizes, the sample ledger, a per-step trace (loss and
learning rate), the weights dumped at one commit (``--dump-at``: the
failure-free phase of a faulted job) and at the end, and the per-step world
sizes an elastic run went through (``--sizes``), for a reference whose math
depends on the world size. Nothing here changes what a script computes.

Files under ``--out``: ``final-<rank>.npz``, ``dump-<rank>.npz``,
``trace-<pid>.jsonl``, the ledger's ``steps-<pid>.jsonl`` (elastic mode) and
the fault markers (``faults/``).
"""

import argparse
import json
import os
import sys
import time
import types

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from examples.digits import load_digits  # noqa: E402


def arguments(description, epochs=2, global_batch=60, commit_every=4):
    """The command line every corpus script takes (a script adds its own options)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="directory for weights, traces and the ledger")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--reference", action="store_true", help="one process, no Horovod, whole global batch")
    mode.add_argument("--plain", action="store_true", help="Horovod's hvd.elastic state and run, no elastic_ext")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--global-batch", type=int, default=global_batch)
    parser.add_argument("--commit-every", type=int, default=commit_every)
    parser.add_argument("--seed", type=int, default=0)
    # The test's hooks.
    parser.add_argument("--faults", default="", help="RANK:STEP[:HOW],... (devkit.faults.FaultSchedule)")
    parser.add_argument("--resize-at", default="", help="STEP:HOSTFILE:HOST,... (HostFileSchedule)")
    parser.add_argument("--dump-at", type=int, default=-1, help="dump the weights at the commit of this step")
    parser.add_argument("--sizes", default="", help="reference: JSON file {step: world size} of an elastic run")
    parser.add_argument("--leave-frees", default="", help="HOSTFILE: at rank 1's SIGTERM, rank 0 takes the "
                                                          "leaver's slot out of this discovery host file, as a host "
                                                          "going away does, so that no newcomer replaces it")
    parser.add_argument("--slow-below", default="", help="SIZE:SECONDS: while the world has fewer than SIZE "
                                                         "workers each step sleeps SECONDS (a newcomer then "
                                                         "joins while the job trains, not at its end)")
    return parser


def mode(args):
    return "reference" if args.reference else "plain" if args.plain else "elastic"


def digits(samples, seed=0):
    """``samples`` of the 1797 digit images (a fixed draw), as (float32 (n, 64) in [0, 1], int64 labels)."""
    data = load_digits()
    pick = np.random.default_rng(seed).permutation(len(data.target))[:samples]
    return (data.data[pick] / 16.0).astype(np.float32), data.target[pick].astype(np.int64)


def one_process():
    """The reference's world for an elastic sampler: rank 0 of 1, so each step is the whole global batch."""
    return {"world": lambda: (0, 1)}


class LocalState(types.SimpleNamespace):
    """The reference's stand-in for a State: attributes, and a commit that does nothing."""

    generation = 0

    def commit(self):
        pass

    def register_reset_callbacks(self, callbacks):
        pass


def plain_handlers(hvd_elastic_state, *types_with_state_dict):
    """Under ``--plain``: Horovod's TorchState handles objects of these types (a sampler, a scheduler) by
    ``state_dict()``, saved by deep copy and synced by ``broadcast_object``: its own handler for its sampler."""
    registry = hvd_elastic_state.get_handler_registry()
    for kind in types_with_state_dict:
        if not any(kind is known for known, _ in registry):
            registry.append((kind, hvd_elastic_state.SamplerStateHandler))
    hvd_elastic_state.set_handler_registry(registry)


class Hooks:
    """The test's hooks in one worker (or the reference's process)."""

    def __init__(self, args, rank_fn=lambda: 0, size_fn=lambda: 1):
        self.args = args
        self.mode = mode(args)
        self.rank, self.size = rank_fn, size_fn
        os.makedirs(args.out, exist_ok=True)
        self.faults = self.resizes = self.ledger = None
        if self.mode != "reference":
            from devkit.faults import FaultSchedule, HostFileSchedule
            self.faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
            self.resizes = HostFileSchedule(args.resize_at)
        if self.mode == "elastic":
            from devkit.ledger import Ledger
            self.ledger = Ledger(args.out)
        self._trace = open(os.path.join(args.out, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
        self._sizes = {}
        self._slow = None
        if args.slow_below:
            size, seconds = args.slow_below.split(":")
            self._slow = (int(size), float(seconds))
        if args.sizes:
            with open(args.sizes) as handle:
                self._sizes = {int(k): int(v) for k, v in json.load(handle).items()}

    def world_size_at(self, step):
        """The world size the elastic run had at ``step`` (reference with ``--sizes``), else this job's."""
        if self.mode == "reference" and self._sizes:
            known = [k for k in self._sizes if k <= step]
            if not known:
                raise KeyError(f"--sizes {self.args.sizes} has no step at or before {step}")
            return self._sizes[max(known)]  # past a failed run's last step: its last size
        return self.size()

    def started(self, state, epoch=0, cursor=0):
        if self.ledger is not None:
            self.ledger.start(state.generation, epoch, cursor, state.step, self.rank(), self.size())

    def step(self, state, epoch=0, cursor=0, indices=None):
        """Before a step's forward pass: a declared fault fires; the step's samples go to the ledger."""
        if self.faults is not None:
            if self.args.leave_frees and self.mode == "elastic" and self.rank() == 0 and any(
                    (f.rank, f.step, f.how, f.where) == (1, state.step, "term", "step") for f in self.faults.faults):
                self._free_slot(state)  # not by rank 1's marker: rank 1 may have fired already
            self.faults.maybe_fire(self.rank(), state.step)
        if self._slow is not None and self.mode != "reference" and self.size() < self._slow[0]:
            time.sleep(self._slow[1])  # pacing, not synchronisation: the job goes on whenever it may
        if self.ledger is not None and indices is not None:
            indices = np.asarray(indices)
            self.ledger.step(state.generation, epoch, cursor, state.step, self.rank(), self.size(), indices, 0)

    def _free_slot(self, state, wait_s=60.0):
        """Rank 0, at the step where rank 1 gets its SIGTERM: one slot fewer on rank 0's host in the host
        file, as a host going away, waited for until Horovod's driver has announced it (to rank 0, its
        coordinator). The leave and the host change then meet at the next commit, and no newcomer
        replaces the leaver. Ranks are host-major, so with 2 slots per host rank 1 is rank 0's host's
        local rank 1, the one Horovod drops when that host loses a slot."""
        path, host = self.args.leave_frees, os.environ["HOROVOD_HOSTNAME"]
        marker = path + ".freed"
        if os.path.exists(marker):
            return
        with open(path) as handle:
            slots = dict(line.strip().rsplit(":", 1) for line in handle if line.strip())
        if int(slots.get(host, 0)) != 2:
            raise RuntimeError(f"--leave-frees {path}: rank 0's host {host!r} must have 2 slots, has {slots}")
        slots[host] = 1
        from devkit.faults import announce_hosts
        if not announce_hosts(state, path, [f"{name}:{count}" for name, count in slots.items()], marker, wait_s):
            raise RuntimeError(f"Horovod's driver did not announce the host file's change within {wait_s} s")

    def record(self, state, epoch, cursor, indices):
        """The step's samples to the ledger only (where a fault fires elsewhere: ``model.fit``)."""
        if self.ledger is not None:
            self.ledger.step(state.generation, epoch, cursor, state.step, self.rank(), self.size(),
                             np.asarray(indices), 0)

    def trace(self, state, **values):
        """After a step: this rank's values of it (a loss, the learning rate) to the trace."""
        record = {"step": state.step, "rank": self.rank(), "size": self.size(),
                  "gen": getattr(state, "generation", 0)}
        record.update({k: float(v) for k, v in values.items()})
        self._trace.write(json.dumps(record) + "\n")

    def before_commit(self, state):
        """Rank 0 rewrites the host file at a scheduled resize (elastic mode)."""
        if self.mode == "elastic" and self.resizes is not None:
            self.resizes.maybe_apply(state, self.rank(), state.step)

    def committed(self, state, arrays):
        """After a commit: the weights at ``--dump-at`` (``arrays``: a function returning name -> array)."""
        self.dump_if(state.step, arrays)

    def dump_if(self, step, arrays):
        """The weights at ``--dump-at`` (``step``: the steps trained so far)."""
        if step == self.args.dump_at:
            self._save(f"dump-{self.rank()}.npz", arrays())

    def finish(self, state, arrays):
        self._save(f"final-{self.rank()}.npz", arrays())
        if self.ledger is not None:
            self.ledger.end(state.step, self.rank(), self.size())

    def _save(self, name, arrays):
        path = os.path.join(self.args.out, name)
        np.savez(path + ".tmp.npz", **{k: np.asarray(v) for k, v in arrays.items()})
        os.replace(path + ".tmp.npz", path)


def torch_arrays(model=None, optimizer=None, prefix="", **extra):
    """Model parameters and buffers (``model/<name>``), optimizer state (``opt/<id>/<key>``) and the
    learning rates (``lr/<group>``) as numpy arrays, for the final and dumped weights."""
    import torch
    arrays = {}
    if model is not None:
        for name, value in model.state_dict().items():
            arrays[f"{prefix}model/{name}"] = value.detach().float().numpy().copy() \
                if value.dtype == torch.bfloat16 else value.detach().numpy().copy()
    if optimizer is not None:
        for pid, entries in optimizer.state_dict()["state"].items():
            for key, value in entries.items():
                arrays[f"{prefix}opt/{pid}/{key}"] = value.numpy().copy() if torch.is_tensor(value) \
                    else np.asarray(value)
        for i, group in enumerate(optimizer.param_groups):
            arrays[f"{prefix}lr/{i}"] = np.asarray(group["lr"], dtype=np.float64)
    arrays.update({k: np.asarray(v) for k, v in extra.items()})
    return arrays

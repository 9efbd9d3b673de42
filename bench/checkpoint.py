"""Training stall of a durable checkpoint vs a synchronous ``torch.save``, side by side.

Run from the repository root: ``.venv/bin/python -m bench.checkpoint``.

One process, one model (~34M parameters, two 4096x4096 layers) with Adam
state (~400 MB in all), one directory. Each repetition measures, in turn:

- ``plain_commit_s``: ``State.commit()`` without checkpoints (the host
  snapshot elastic training pays anyway, for in-memory rollback);
- ``durable_commit_s``: ``State.commit()`` with ``checkpoint_dir`` set and a
  checkpoint due: the snapshot plus handing it to the background writer.
  This is the training stall; the write (SHA-256, fsync, rename, manifest)
  then runs on a thread while training steps go on;
- ``torch_save_s``: ``torch.save`` of the model and optimizer state_dicts to
  the same directory (no fsync, as users usually call it), and
  ``torch_save_fsync_s`` the same followed by fsync;
- ``sync_durable_write_s``: our own format written synchronously (what the
  stall would be without the background thread);
- step times while the background write runs vs idle (interference).

The stall a durable checkpoint *adds* is ``durable_commit_s - plain_commit_s``;
the headline ratio divides it by ``torch_save_s``. The ratio of the whole
durable commit (snapshot included) to ``torch_save_s`` is reported as well.
Before each measured commit the previous write is awaited (outside the
timing): the regime where writes keep up with the checkpoint interval (a
write that does not keep up skips the next due checkpoint instead of
stalling the commit).

Writes ``bench/results/checkpoint.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Dict, List

import numpy as np
import torch

from bench import harness
from bench.models import mlp
from elastic_ext.checkpoint import write_checkpoint
from elastic_ext.config import ElasticConfig
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on

def build(width: int) -> tuple:
    model = mlp([width, width, width])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    started = time.perf_counter()
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return time.perf_counter() - started


def timed(fn) -> float:
    return harness.timed(fn)[0]


def torch_save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsync: bool) -> None:
    with open(path, "wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=4096, help="layer width (2 layers: ~2*width^2 parameters)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the training steps (2: every "
                        "core of this machine trains, as on a busy node)")
    parser.add_argument("--max-steps", type=int, default=200, help="training steps run while one write goes on; "
                        "the rest of a longer write is waited for and counted as lost")
    parser.add_argument("--name", default="checkpoint", help="result file stem under bench/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    machine = harness.machine(torch=torch.__version__, numpy=np.__version__)
    root = args.dir or tempfile.mkdtemp(prefix="elastic_ext_bench_ckpt_")
    os.makedirs(root, exist_ok=True)
    ckpt_dir = os.path.join(root, "ckpt")
    model, optimizer = build(args.width)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    step(model, optimizer, x)  # Adam state exists from here on
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for st in optimizer.state_dict()["state"].values() for v in st.values()
        if torch.is_tensor(v))

    plain = state_on(SoloBinding(), config=ElasticConfig(), model=model, optimizer=optimizer, step=0)
    durable = state_on(SoloBinding(), config=ElasticConfig(checkpoint_dir=ckpt_dir, checkpoint_every=1,
                                                           checkpoint_keep_last=2),
                       model=model, optimizer=optimizer, step=0)
    plain.sync()
    durable.sync()
    # Warm-up: buffers allocated and faulted in, files exist, caches warm.
    plain.commit()
    durable.commit()
    durable.wait_for_checkpoint()
    torch_save(os.path.join(root, "torch_save.pt"), model, optimizer, fsync=False)

    rows: Dict[str, List[float]] = {k: [] for k in (
        "plain_commit_s", "durable_commit_s", "torch_save_s", "torch_save_fsync_s", "sync_durable_write_s",
        "background_write_s", "step_idle_s", "step_during_write_s", "steps_during_write", "lost_training_s")}
    try:
        for rep in range(args.reps):
            step(model, optimizer, x)
            rows["plain_commit_s"].append(timed(plain.commit))

            step(model, optimizer, x)
            durable.wait_for_checkpoint()
            durable_commit = timed(durable.commit)
            rows["durable_commit_s"].append(durable_commit)
            during = []
            while durable.wait_for_checkpoint(0) != durable.commit_id and len(during) < args.max_steps:
                during.append(step(model, optimizer, x))
            waited = timed(durable.wait_for_checkpoint)  # a write still running after max_steps stalls training
            event = [e for e in durable.events.history if e["event"] == "checkpoint"][-1]
            assert event["commit_id"] == durable.commit_id, event
            rows["background_write_s"].append(event["duration_s"])
            rows["steps_during_write"].append(len(during))
            if during:
                rows["step_during_write_s"].append(statistics.median(during))
            idle = statistics.median([step(model, optimizer, x) for _ in range(max(3, len(during)))])
            rows["step_idle_s"].append(idle)
            # Training time lost to this checkpoint: the stall plus steps slowed by the write.
            rows["lost_training_s"].append(durable_commit + waited + sum(during) - idle * len(during))

            rows["torch_save_s"].append(timed(lambda: torch_save(os.path.join(root, "torch_save.pt"), model,
                                                                 optimizer, fsync=False)))
            rows["torch_save_fsync_s"].append(timed(lambda: torch_save(os.path.join(root, "torch_save.pt"), model,
                                                                       optimizer, fsync=True)))
            entries = dict(durable._entries)  # the last commit's entries: model, optimizer, step
            rows["sync_durable_write_s"].append(timed(lambda: write_checkpoint(
                os.path.join(root, "sync"), 1, entries, {})))
            print(f"rep {rep}: plain commit {rows['plain_commit_s'][-1]:.3f}s, durable commit {durable_commit:.3f}s, "
                  f"torch.save {rows['torch_save_s'][-1]:.3f}s, background write {event['duration_s']:.3f}s",
                  flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) if v else None for k, v in rows.items()}
    added = max(med["durable_commit_s"] - med["plain_commit_s"], 0.0)
    result: Dict[str, Any] = {
        "benchmark": "checkpoint",
        "what": "training stall of State.commit with an asynchronous durable checkpoint vs synchronous torch.save",
        "parameters": params, "state_bytes": state_bytes, "reps": args.reps, "torch_threads": args.threads,
        "machine": dict(machine, load_average_at_end=list(os.getloadavg())),
        "samples": rows,
        "summary": {k: harness.summary(v) for k, v in rows.items() if v},
        "added_stall_s": added,
        "ratio_added_stall_to_torch_save": added / med["torch_save_s"],
        "ratio_durable_commit_to_torch_save": med["durable_commit_s"] / med["torch_save_s"],
        "ratio_durable_commit_to_torch_save_fsync": med["durable_commit_s"] / med["torch_save_fsync_s"],
        "ratio_durable_commit_to_sync_durable_write": med["durable_commit_s"] / med["sync_durable_write_s"],
        "step_slowdown_during_write": (med["step_during_write_s"] / med["step_idle_s"]
                                       if med["step_during_write_s"] else None),
        "ratio_lost_training_to_torch_save": med["lost_training_s"] / med["torch_save_s"],
        "target": "added stall <= 0.1 x torch.save; training lost per checkpoint <= 0.25 x torch.save",
    }
    result["meets_target"] = (result["ratio_added_stall_to_torch_save"] <= 0.1
                              and result["ratio_lost_training_to_torch_save"] <= 0.25)
    path = harness.write_json(args.name, result)
    chart(args.name, result)

    print(f"\n{params / 1e6:.1f}M parameters + Adam, {state_bytes / 2**20:.0f} MiB of state, "
          f"median of {args.reps} repetitions")
    for key in ("plain_commit_s", "durable_commit_s", "torch_save_s", "torch_save_fsync_s", "sync_durable_write_s",
                "background_write_s", "step_idle_s", "step_during_write_s", "lost_training_s"):
        if med[key] is not None:
            print(f"  {key:24s} {med[key]:8.4f} s")
    print(f"  stall added by the durable checkpoint: {added:.4f} s = "
          f"{result['ratio_added_stall_to_torch_save']:.3f} x torch.save (target <= 0.1)")
    print(f"  whole durable commit (snapshot included): {result['ratio_durable_commit_to_torch_save']:.3f} x "
          f"torch.save, {result['ratio_durable_commit_to_torch_save_fsync']:.3f} x torch.save+fsync")
    print(f"  training time lost per checkpoint (stall + steps slowed by the write): {med['lost_training_s']:.3f} s "
          f"= {result['ratio_lost_training_to_torch_save']:.2f} x torch.save")
    print(f"wrote {path}")
    print(json.dumps({k: result[k] for k in ("added_stall_s", "ratio_added_stall_to_torch_save",
                                             "ratio_durable_commit_to_torch_save", "meets_target")}))


def chart(name: str, result: Dict[str, Any]) -> str:
    """``<name>.png``: torch.save beside the durable commit's stall and the training it lost."""
    summary = result["summary"]
    torch_save = summary["torch_save_s"]["median"]
    return harness.bar_chart(name, f"{result['state_bytes'] / 2**20:.0f} MiB, {result['torch_threads']} training "
                             "thread(s)", [{
                                 "ylabel": "seconds (median)",
                                 "labels": ["torch.save", "elastic_ext stall", "elastic_ext lost training"],
                                 "values": [torch_save, summary["durable_commit_s"]["median"],
                                            summary["lost_training_s"]["median"]],
                                 "target": 0.25 * torch_save, "target_label": "0.25 x torch.save"}])


if __name__ == "__main__":
    main()

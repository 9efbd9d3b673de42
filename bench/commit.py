"""Commit cost: elastic_ext ``State.commit()`` against Horovod's ``TorchState.commit()``.

Issue target: on the same model (tens of millions of parameters, Adam), our
commit takes at most half the time of Horovod's, and keeps no more extra
host memory than one copy of model plus optimizer state.

Run from the repository root::

    .venv/bin/python -m bench.commit

Horovod is initialised with a plain ``hvd.init()`` in a single process (a
world of one, MPI singleton; no ``horovodrun`` needed). Both commits then run
their real host-update check: elastic_ext a max-allreduce of three int64s,
Horovod a ``broadcast_object`` of a tuple.

How it measures:

- time: one child process holds both states on the same model and optimizer
  and alternates them (A B, B A, ...) after a warm-up, so a busy machine
  slows both alike; ``save()`` (the copy alone, no collective) is timed the
  same way.
- memory: a fresh child process per system, so one system's freed pages and
  the allocator's reuse of them never show up in the other's figures. It
  records RSS before the state exists, RSS after each commit (what keeping a
  commit costs) and VmHWM during each commit (the transient peak), all in
  units of the payload: bytes of model parameters and buffers plus the
  optimizer's state tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

from bench import harness
from bench.models import mlp

NAME = "commit"
SYSTEMS = ("elastic_ext", "elastic_ext_2buf", "horovod")
TIME_TARGET = 0.5       # our commit time / Horovod's
MEMORY_TARGET = 1.0     # extra host memory, in copies of model + optimizer state
# RSS also counts the snapshot's Python objects and moves by whole pages; a copy plus this is "one copy".
MEMORY_SLACK = 0.01
DEFAULT_SHAPES = ("2048x8", "4096x2")
DEFAULT_REPS = 11
DEFAULT_COMMITS = 5


def build(width: int, depth: int, seed: int = 0):
    """An MLP of ``depth`` square Linear layers, and Adam after one real step (state populated)."""
    import torch

    model = mlp([width] * (depth + 1), activation="GELU", seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(16, width)).square().mean().backward()
    optimizer.step()
    # Gradients are not committed by either system; drop them so RSS shows only the payload.
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def payload_bytes(model, optimizer) -> Dict[str, int]:
    """Bytes both systems must snapshot: the model's state_dict and the optimizer's state tensors."""
    import torch

    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    optim_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    params = sum(p.numel() for p in model.parameters())
    return {"model": model_bytes, "optimizer": optim_bytes, "total": model_bytes + optim_bytes, "parameters": params}


def make_state(system: str, model, optimizer):
    """The state object of ``system``, built through each library's public path."""
    if system == "horovod":
        import horovod.torch as hvd
        return hvd.elastic.TorchState(model=model, optimizer=optimizer)
    import elastic_ext
    # An explicit config, so ELASTIC_EXT_* variables in the caller's shell cannot change the figures.
    config = elastic_ext.ElasticConfig(commit_buffers=2 if system == "elastic_ext_2buf" else 1)
    return elastic_ext.State(model=model, optimizer=optimizer, config=config)


def _init_horovod() -> None:
    import horovod.torch as hvd
    hvd.init()
    if hvd.size() != 1:
        raise RuntimeError(f"run this benchmark as a single process (hvd.size() is {hvd.size()})")


def _check_restores(states: Dict[str, Any], model, optimizer) -> None:
    """Each system brings a perturbed model and optimizer back to its last commit, bitwise."""
    import torch

    reference = {k: v.clone() for k, v in model.state_dict().items()}
    first_param = next(iter(optimizer.state))
    reference_avg = optimizer.state[first_param]["exp_avg"].clone()
    for name, state in states.items():
        state.commit()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        optimizer.state[first_param]["exp_avg"].add_(1.0)
        state.restore()
        model_now = model if name != "horovod" else state.model
        optimizer_now = optimizer if name != "horovod" else state.optimizer
        for key, value in model_now.state_dict().items():
            if not torch.equal(value, reference[key]):
                raise AssertionError(f"{name}: restore() did not bring back {key}")
        if not torch.equal(optimizer_now.state[next(iter(optimizer_now.state))]["exp_avg"], reference_avg):
            raise AssertionError(f"{name}: restore() did not bring back Adam's exp_avg")


def _touch(model, optimizer) -> None:
    """Writes every parameter and Adam moment in place, values unchanged (untimed), as the optimizer
    step between two commits does: a commit may copy only what was written since the last one
    (``elastic_ext.state.written``), so commits with nothing written between them would time nothing."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.0)
        for slots in optimizer.state.values():
            for value in slots.values():
                if torch.is_tensor(value) and value.dim():
                    value.mul_(1.0)


def child_time(args: argparse.Namespace) -> Dict[str, Any]:
    _init_horovod()
    model, optimizer = build(args.width, args.depth)
    states = {system: make_state(system, model, optimizer) for system in SYSTEMS}
    _check_restores(states, model, optimizer)
    times: Dict[str, Dict[str, List[float]]] = {s: {"commit": [], "save": []} for s in SYSTEMS}
    for op in ("commit", "save"):
        calls: Dict[str, Callable[[], None]] = {s: getattr(states[s], op) for s in SYSTEMS}
        for _ in range(args.warmup):
            for system in SYSTEMS:
                _touch(model, optimizer)
                calls[system]()
        for rep in range(args.reps):
            # Rotate who goes first so a cache or allocator effect of the order cancels out.
            order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]
            for system in order:
                _touch(model, optimizer)
                gc.collect()
                started = time.perf_counter()
                calls[system]()
                times[system][op].append(time.perf_counter() - started)
    return {"times_s": times, "payload": payload_bytes(model, optimizer)}


def child_memory(args: argparse.Namespace) -> Dict[str, Any]:
    _init_horovod()
    # Imported before the baseline: module code is not memory a commit keeps.
    import elastic_ext  # noqa: F401
    model, optimizer = build(args.width, args.depth)
    # Trimmed: heap left free by the forward/backward pass would count in the baseline and
    # a later allocation that reuses it would look free.
    base = harness.settled_rss()
    harness.reset_peak()
    started = time.perf_counter()
    # Horovod's constructor already deep-copies the state; ours allocates at the first commit.
    state = make_state(args.system, model, optimizer)
    construction_s = time.perf_counter() - started
    after_init = harness.proc_memory()
    commits = []
    for _ in range(args.commits):
        _touch(model, optimizer)
        gc.collect()
        before = harness.proc_memory()["rss"]
        harness.reset_peak()
        started = time.perf_counter()
        state.commit()
        elapsed = time.perf_counter() - started
        now = harness.proc_memory()
        commits.append({"rss_before": before, "rss_after": now["rss"], "peak": now["peak"], "seconds": elapsed})
    # What stays live once the allocator gives back what it merely keeps for reuse.
    trimmed = harness.settled_rss()
    return {"system": args.system, "baseline_rss": base, "rss_after_trim": trimmed, "after_construction": after_init,
            "construction_s": construction_s,
            "commits": commits, "payload": payload_bytes(model, optimizer)}


def measure_shape(width: int, depth: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Memory children (one per system), then the interleaved timing child, for one model shape."""
    shape = ["--width", str(width), "--depth", str(depth)]
    memory = {s: harness.run_child("bench.commit", ["--child", "memory", "--system", s, "--commits",
                                                   str(args.commits), *shape], timeout_s=300) for s in SYSTEMS}
    timing = harness.run_child("bench.commit", ["--child", "time", "--reps", str(args.reps), "--warmup",
                                               str(args.warmup), *shape], timeout_s=600)
    payload = timing["payload"]
    unit = payload["total"]
    results: Dict[str, Any] = {}
    for system in SYSTEMS:
        mem = memory[system]
        steady = mem["commits"][-1]["rss_after"] - mem["baseline_rss"]
        peak = max(c["peak"] for c in mem["commits"]) - mem["baseline_rss"]
        samples = timing["times_s"][system]
        results[system] = {
            "commit_s": harness.summary(samples["commit"]),
            "save_s": harness.summary(samples["save"]),
            "first_copy_s": mem["construction_s"] + mem["commits"][0]["seconds"],
            "extra_rss_steady_bytes": steady, "extra_rss_peak_bytes": peak,
            "extra_rss_steady_payloads": steady / unit, "extra_rss_peak_payloads": peak / unit,
            "extra_rss_live_payloads": (mem["rss_after_trim"] - mem["baseline_rss"]) / unit,
            "samples_s": samples, "memory_trace": mem,
        }
    ours, theirs = results["elastic_ext"], results["horovod"]
    paired = {op: statistics.median(a / b for a, b in zip(ours["samples_s"][op], theirs["samples_s"][op]))
              for op in ("commit", "save")}
    ratios = {
        "commit_median": ours["commit_s"]["median"] / theirs["commit_s"]["median"],
        "commit_min": ours["commit_s"]["min"] / theirs["commit_s"]["min"],
        "commit_paired_median": paired["commit"],
        "save_median": ours["save_s"]["median"] / theirs["save_s"]["median"],
        "save_min": ours["save_s"]["min"] / theirs["save_s"]["min"],
        "save_paired_median": paired["save"],
        "extra_rss_steady": ours["extra_rss_steady_bytes"] / theirs["extra_rss_steady_bytes"],
        "extra_rss_peak": ours["extra_rss_peak_bytes"] / theirs["extra_rss_peak_bytes"],
    }
    limit = MEMORY_TARGET * (1 + MEMORY_SLACK)
    targets = {
        "time_ratio_at_most": TIME_TARGET,
        # Both the typical (median) and the best-case (min) ratio must meet it: on a shared
        # machine a median alone can be won by the other system's bad luck.
        "time_met": max(ratios["commit_median"], ratios["commit_min"]) <= TIME_TARGET,
        "extra_memory_payloads_at_most": MEMORY_TARGET,
        "memory_slack": f"{MEMORY_SLACK:.0%} of the payload for interpreter objects and RSS noise",
        "steady_memory_met": ours["extra_rss_steady_payloads"] <= limit,
        "peak_memory_met": ours["extra_rss_peak_payloads"] <= limit,
    }
    return {"model": {"kind": "MLP", "width": width, "depth": depth, "optimizer": "Adam (one step taken)",
                      "device": "cpu", "parameters": payload["parameters"],
                      "largest_tensor_bytes": width * width * 4},
            "payload_bytes": payload, "results": results,
            "ratios_elastic_ext_over_horovod": ratios, "targets": targets}


def drive(args: argparse.Namespace, argv: List[str]) -> int:
    info = harness.machine()
    shapes = [tuple(int(x) for x in item.lower().split("x")) for item in args.shapes.split(",")]
    measured = {f"{w}x{d}": measure_shape(w, d, args) for w, d in shapes}
    data = {
        "benchmark": NAME,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "command": " ".join([".venv/bin/python -m bench.commit", *argv]).strip(),
        "machine": info,
        "reps": args.reps, "warmup": args.warmup, "commits_per_memory_child": args.commits,
        "horovod_init": "hvd.init() in a single process (world of one, MPI singleton)",
        "shapes": measured,
    }
    harness.write_json(args.name, data)

    print(f"{info['cpus']} CPUs ({info['cpu_model']}), load average at start {info['load_average_at_start'][0]:.2f}; "
          f"{args.reps} interleaved reps after {args.warmup} warm-up")
    rows = []
    for key, m in measured.items():
        for system in SYSTEMS:
            r = m["results"][system]
            rows.append([key, system, r["commit_s"]["median"] * 1e3, r["commit_s"]["min"] * 1e3,
                         r["save_s"]["median"] * 1e3, r["first_copy_s"] * 1e3,
                         r["extra_rss_steady_payloads"], r["extra_rss_live_payloads"], r["extra_rss_peak_payloads"]])
    print(harness.table(["model", "system", "commit med ms", "commit min ms", "save med ms", "new+1st ms",
                        "extra RSS", "live", "peak extra"], rows))
    print("(extra RSS in payloads = bytes of model state_dict + Adam state; "
          + ", ".join(f"{k}: {m['payload_bytes']['total'] / harness.MIB:.0f} MiB" for k, m in measured.items()) + ")")
    for key, m in measured.items():
        r, t = m["ratios_elastic_ext_over_horovod"], m["targets"]
        ours = m["results"]["elastic_ext"]
        print(f"{key}: elastic_ext/horovod commit median {r['commit_median']:.2f} (paired {r['commit_paired_median']:.2f}, "
              f"min {r['commit_min']:.2f}; target <= {TIME_TARGET}: {'met' if t['time_met'] else 'MISSED'}); "
              f"extra memory steady {ours['extra_rss_steady_payloads']:.3f} / peak {ours['extra_rss_peak_payloads']:.3f} "
              f"payloads (target <= {MEMORY_TARGET}: {'met' if t['steady_memory_met'] and t['peak_memory_met'] else 'MISSED'})")

    labels = [f"{system}\n{key}" for key in measured for system in ("elastic_ext", "horovod")]
    pick = lambda field, scale=1.0: [m["results"][s][field]["median"] * scale if isinstance(m["results"][s][field], dict)
                                     else m["results"][s][field] * scale
                                     for m in measured.values() for s in ("elastic_ext", "horovod")]
    harness.bar_chart(args.name, f"commit(): 33.6M-parameter MLPs + Adam, CPU ({info['cpus']} cores)", [
        {"ylabel": "commit time, elastic_ext / horovod", "labels": [f"elastic_ext/horovod\n{k}" for k in measured],
         "values": [m["ratios_elastic_ext_over_horovod"]["commit_median"] for m in measured.values()],
         "target": TIME_TARGET},
        {"ylabel": "commit median (ms)", "labels": labels, "values": pick("commit_s", 1e3)},
        {"ylabel": "extra RSS kept (payloads)", "labels": labels, "values": pick("extra_rss_steady_payloads"),
         "target": MEMORY_TARGET},
        {"ylabel": "peak extra RSS (payloads)", "labels": labels, "values": pick("extra_rss_peak_payloads"),
         "target": MEMORY_TARGET},
    ])
    return 0


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help="comma-separated WIDTHxDEPTH MLPs (default %(default)s: 33.6M parameters each)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed calls per system and operation")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--commits", type=int, default=DEFAULT_COMMITS, help="commits per memory child")
    parser.add_argument("--name", default=NAME, help="result file stem under bench/results (default %(default)s)")
    parser.add_argument("--child", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "time":
        print(json.dumps(child_time(args)))
        return 0
    if args.child == "memory":
        print(json.dumps(child_memory(args)))
        return 0
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

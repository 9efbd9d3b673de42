"""Re-partitioning and a newcomer's first batch: the virtual epoch order against the materialised one.

Issue targets: a newcomer's first batch in at most 1 ms at 10M and at 1B
samples, with memory independent of the dataset size, and a shuffle that
stays statistically sound; re-partitioning after a resize within 50 ms, side
by side with Horovod's ``ElasticSampler``.

    .venv/bin/python -m bench.partition [--sizes 10000000,100000000,1000000000] [--reps 3]

The scenario: an epoch shuffled by ``(seed, epoch)``, 256 samples per rank per
step, 8 workers; 37% of the epoch is consumed (whole global steps), then the
job shrinks to 6 workers. Three experiments in one run:

1. **Newcomer's first batch**, at every ``--sizes``: a fresh process restores
   the committed position and computes its first batch.
   - ``new``: :class:`elastic_ext.ElasticPartitioner`, ``load_state_dict``,
     ``next(batches())``: the order is a keyed Feistel permutation computed
     per position (``elastic_ext.data.partition.FeistelOrder``).
   - ``old``: the approach it replaced, kept here as the baseline
     (:func:`old_epoch_order`): ``np.arange(size)`` shuffled by numpy's PCG64,
     then this rank's slice. Measured up to ``--old-max-size`` (default
     100M: 400 MB); above it the old order would need ``4 * size`` bytes
     (4 GB at 1B, on a 2-core machine shared with other jobs), so its time
     and memory are **extrapolated** linearly from the largest measured size
     and marked so in the JSON and the plot.
   Time: one process per size alternates old and new. Memory: a fresh
   process per (system, size), tracemalloc peak and RSS peak of the call.
2. **Resize at ``--size``** (10M): a survivor's ``plan()`` against Horovod's
   ``ElasticSampler.reset()`` (a Python list of all indices, shuffled; at a
   world of one, ``hvd.init()`` in this process), time and memory, with a
   correctness check: the 6 ranks' plans hold every unconsumed position once.
3. **Shuffle quality** (bench/partition_quality.py): position uniformity
   (chi-square) and the correlation of positions between consecutive epochs,
   new and old side by side.

Writes bench/results/partition.json and partition.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any, Dict, List

import numpy as np

from bench import harness, partition_quality

NAME = "partition"
FIRST_BATCH_TARGET_S = 0.001
RESIZE_TARGET_S = 0.050
SIZES = (10_000_000, 100_000_000, 1_000_000_000)
OLD_MAX_SIZE = 100_000_000
OLD_QUALITY_MAX_SIZE = 10_000_000  # the old order's inverse, int64, for the between-epochs check
SIZE = 10_000_000
BATCH = 256           # per rank per step
OLD_WORLD, NEW_WORLD = 8, 6
CONSUMED = 0.37
SEED = 0
RANK = 3              # the newcomer's rank: its share starts inside the global step


# ------------------------------------------------------------- the baseline

def old_epoch_order(size: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch order as elastic_ext built it before the virtual order: the whole permutation, materialised."""
    order = np.arange(size, dtype=np.int32 if size < 2 ** 31 else np.int64)
    np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).shuffle(order)
    return order


def old_first_batch(committed: Dict[str, Any], rank: int) -> np.ndarray:
    """A newcomer's first batch the old way: build the epoch's order, slice this rank's share of the next step."""
    order = old_epoch_order(committed["size"], committed["seed"], committed["epoch"])
    start = committed["cursor"] + rank * BATCH
    return order[start:start + BATCH].copy()


# ---------------------------------------------------------------- scenario

def committed_position(size: int) -> Dict[str, Any]:
    """What ``ElasticPartitioner.state_dict()`` holds after CONSUMED of the epoch at OLD_WORLD workers."""
    cursor = int(size * CONSUMED) // (BATCH * OLD_WORLD) * BATCH * OLD_WORLD
    return {"epoch": 0, "cursor": cursor, "size": size, "seed": SEED, "shuffle": True, "policy": "pad"}


def partitioner(size: int, rank: int, world_size: int, committed: Dict[str, Any]):
    from elastic_ext import ElasticPartitioner

    sampler = ElasticPartitioner(size, batch_size=BATCH, seed=SEED, policy="pad",
                                 world=lambda: (rank, world_size))
    sampler.load_state_dict(committed)
    return sampler


def new_first_batch(committed: Dict[str, Any], rank: int) -> np.ndarray:
    """A newcomer's first batch now: restore the position, take the first step of ``batches()``."""
    indices, _ = next(partitioner(committed["size"], rank, NEW_WORLD, committed).batches())
    return indices


FIRST_BATCH = {"old": old_first_batch, "new": new_first_batch}


def check_plans(size: int, committed: Dict[str, Any]) -> Dict[str, Any]:
    """Asserts that the 6 ranks' plans after the resize hold every unconsumed position exactly once.

    Raises:
        AssertionError: a position is missing, repeated, or already consumed.
    """
    from elastic_ext.data import partition

    taken, padding = [], 0
    for rank in range(NEW_WORLD):
        plan = partitioner(size, rank, NEW_WORLD, committed).plan()
        taken.append(plan.indices[~plan.pad])
        padding += int(plan.pad.sum())
    order = partition.epoch_order(size, SEED, committed["epoch"])
    unconsumed = np.sort(order[committed["cursor"]:])
    taken_all = np.sort(np.concatenate(taken))
    if not np.array_equal(taken_all, unconsumed):
        raise AssertionError("the plans after the resize do not cover the unconsumed positions exactly once")
    return {"ranks": NEW_WORLD, "unconsumed": int(unconsumed.size), "padding_entries": padding, "ok": True}


# ---------------------------------------------------------------- children

def child_first_batch_time(size: int, reps: int, old: bool) -> Dict[str, Any]:
    """Old and new alternated in one process; checks that each batch is the right slice of its order."""
    from elastic_ext.data import partition

    committed = committed_position(size)
    positions = committed["cursor"] + RANK * BATCH + np.arange(BATCH)
    expected_new = partition.epoch_order(size, SEED, 0).take(positions)
    expected_old = old_epoch_order(size, SEED, 0)[positions] if old else None
    times: Dict[str, List[float]] = {"new": [], "old": []}
    for rep in range(reps):
        for system in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            if system == "old" and not old:
                continue
            gc.collect()
            seconds, batch = harness.timed(lambda: FIRST_BATCH[system](committed, RANK))
            times[system].append(seconds)
            if system == "new" and not np.array_equal(batch, expected_new):
                raise AssertionError("the newcomer's first batch is not its share of the virtual order")
            if system == "old" and not np.array_equal(batch, expected_old):
                raise AssertionError("the old first batch is not its share of the materialised order")
    return {"times_s": {k: v for k, v in times.items() if v}}


def child_first_batch_memory(size: int, system: str) -> Dict[str, Any]:
    import elastic_ext  # noqa: F401  (module code is not the first batch's memory)

    committed = committed_position(size)
    memory, batch = harness.memory_of(lambda: FIRST_BATCH[system](committed, RANK), trace=True)
    return dict(memory, batch=int(batch.size))


def child_resize(size: int, reps: int, inner: int) -> Dict[str, Any]:
    """Survivor plan() and Horovod's reset(), alternated; their memory is in child_resize_memory."""
    import horovod.torch as hvd
    from horovod.torch.elastic import ElasticSampler

    hvd.init()
    committed = committed_position(size)
    survivor = partitioner(size, 0, NEW_WORLD, committed)
    theirs = ElasticSampler(range(size), shuffle=True, seed=SEED)
    theirs.processed_num = committed["cursor"]  # what record_batch() counts up to at a world of one
    times: Dict[str, List[float]] = {"survivor_plan": [], "horovod_reset": [], "horovod_reset_iter": []}
    for rep in range(reps):
        for side in (("ours", "horovod") if rep % 2 == 0 else ("horovod", "ours")):
            gc.collect()
            if side == "ours":
                times["survivor_plan"].extend(harness.timed(survivor.plan)[0] for _ in range(inner))
                continue
            seconds, _ = harness.timed(theirs.reset)
            iter_s, _ = harness.timed(lambda: list(iter(theirs)))
            times["horovod_reset"].append(seconds)
            times["horovod_reset_iter"].append(seconds + iter_s)
            if len(theirs.remaining_indices) != size - committed["cursor"]:
                raise AssertionError(f"Horovod kept {len(theirs.remaining_indices)} indices after reset()")
    return {"times_s": times, "correctness": check_plans(size, committed), "horovod_world_size": hvd.size(),
            "cursor": committed["cursor"]}


def child_resize_memory(size: int, system: str) -> Dict[str, Any]:
    committed = committed_position(size)
    if system == "elastic_ext":
        survivor = partitioner(size, 0, NEW_WORLD, committed)
        return harness.memory_of(survivor.plan, trace=True)[0]
    import horovod.torch as hvd
    from horovod.torch.elastic import ElasticSampler

    hvd.init()
    theirs = ElasticSampler(range(size), shuffle=True, seed=SEED)
    theirs.processed_num = committed["cursor"]
    # tracemalloc would slow Horovod's 10M Python ints several fold: RSS only.
    return harness.memory_of(theirs.reset, trace=False)[0]


# ------------------------------------------------------------------ driver

def child(options: List[str], timeout_s: float = 900) -> Dict[str, Any]:
    return harness.run_child("bench.partition", options, timeout_s)


def first_batches(args: argparse.Namespace) -> Dict[str, Any]:
    """Time and memory of both systems at every size; the old one extrapolated above --old-max-size."""
    rows: Dict[str, Any] = {}
    measured_old = [n for n in args.sizes if n <= args.old_max_size]
    for size in args.sizes:
        old = size <= args.old_max_size
        timing = child(["--child", "first-time", "--size", str(size), "--reps", str(args.reps)]
                       + (["--old"] if old else []))
        row = {"new": {"time_s": harness.summary(timing["times_s"]["new"]), "samples_s": timing["times_s"]["new"],
                       "memory": child(["--child", "first-memory", "--size", str(size), "--system", "new"])}}
        if old:
            row["old"] = {"time_s": harness.summary(timing["times_s"]["old"]), "samples_s": timing["times_s"]["old"],
                          "memory": child(["--child", "first-memory", "--size", str(size), "--system", "old"]),
                          "extrapolated": False}
        rows[str(size)] = row
        print(f"  first batch at {size:,}: new {row['new']['time_s']['median'] * 1e3:.3f} ms"
              + (f", old {row['old']['time_s']['median'] * 1e3:.0f} ms" if old else ""), flush=True)
    if measured_old:
        basis = rows[str(max(measured_old))]["old"]
        for size in args.sizes:
            if size > args.old_max_size:
                scale = size / max(measured_old)
                rows[str(size)]["old"] = {
                    "extrapolated": True, "from_size": max(measured_old),
                    "why": f"not measured: the materialised order alone needs {4 * size / 1e9:.1f} GB "
                           f"(int32 x {size:,}); scaled linearly from {max(measured_old):,} samples",
                    "time_s": {"median": basis["time_s"]["median"] * scale},
                    "memory": {k: v * scale for k, v in basis["memory"].items() if k != "batch"}}
    for row in rows.values():
        if "old" in row:
            row["ratio_old_over_new"] = {
                "time": row["old"]["time_s"]["median"] / row["new"]["time_s"]["median"],
                "tracemalloc_peak": harness.ratio(row["old"]["memory"]["tracemalloc_peak"],
                                                  row["new"]["memory"]["tracemalloc_peak"])}
    return rows


def plot(data: Dict[str, Any], name: str) -> None:
    plt = harness.pyplot()
    rows, sizes = data["first_batch"], [int(s) for s in data["first_batch"]]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for ax, key, scale, ylabel in ((axes[0], "time", 1e3, "newcomer's first batch (ms, median)"),
                                   (axes[1], "memory", 1 / harness.MIB, "first batch, tracemalloc peak (MiB)")):
        for system, color in (("old", "#c05621"), ("new", "#2b6cb0")):
            pts = [(n, rows[str(n)][system]) for n in sizes if system in rows[str(n)]]
            value = (lambda r: r["time_s"]["median"]) if key == "time" else (lambda r: r["memory"]["tracemalloc_peak"])
            label = "old: materialised permutation" if system == "old" else "new: Feistel order (elastic_ext)"
            ax.plot([n for n, r in pts if not r.get("extrapolated")],
                    [value(r) * scale for _, r in pts if not r.get("extrapolated")], "o-", color=color, label=label)
            extra = [(n, r) for n, r in pts if r.get("extrapolated")]
            if extra:
                ax.plot([n for n, _ in extra], [value(r) * scale for _, r in extra], "o", mfc="none", color=color,
                        label="old, extrapolated (not measured)")
        if key == "time":
            ax.axhline(FIRST_BATCH_TARGET_S * 1e3, color="k", linestyle="--", linewidth=1, label="target 1 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("samples per epoch")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.legend(fontsize=7)
    resize = data["resize"]["times_s"]
    labels = ["elastic_ext\nsurvivor plan()", "elastic_ext\nnewcomer 1st batch", "horovod\nreset()"]
    values = [resize["survivor_plan"]["median"] * 1e3,
              rows[str(data["resize"]["size"])]["new"]["time_s"]["median"] * 1e3
              if str(data["resize"]["size"]) in rows else 0.0, resize["horovod_reset"]["median"] * 1e3]
    axes[2].bar(range(3), values, color=["#2b6cb0", "#2b6cb0", "#c05621"])
    axes[2].set_xticks(range(3))
    axes[2].set_xticklabels(labels, fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_ylabel(f"resize at {data['resize']['size'] / 1e6:g}M: median ms (log)", fontsize=9)
    axes[2].axhline(RESIZE_TARGET_S * 1e3, color="k", linestyle="--", linewidth=1)
    for i, value in enumerate(values):
        axes[2].annotate(f"{value:.3g}", (i, value), ha="center", va="bottom", fontsize=7)
    between = data["quality"]["between_epochs"]
    for system, color, shift in (("old", "#c05621", -0.15), ("new", "#2b6cb0", 0.15)):
        for k, item in enumerate(between[system]):
            x = sizes.index(item["size"]) + shift if item["size"] in sizes else k + shift
            axes[3].plot([x] * len(item["pairs"]), [p["z"] for p in item["pairs"]], "o", color=color,
                         label=system if k == 0 else None)
    axes[3].axhspan(-3, 3, color="0.9")
    axes[3].set_xticks(range(len(sizes)))
    axes[3].set_xticklabels([f"{n:.0e}" for n in sizes], fontsize=8)
    axes[3].set_ylabel("position correlation between\nconsecutive epochs (z; |z|<3 shaded)", fontsize=9)
    axes[3].legend(fontsize=7)
    fig.suptitle(f"Epoch order: newcomer's first batch and re-partitioning, CPU ({data['machine']['cpus']} cores)",
                 fontsize=10)
    harness.save_figure(fig, name, dpi=110)


def drive(args: argparse.Namespace, argv: List[str]) -> int:
    info = harness.machine()
    print("newcomer's first batch, old (materialised) vs new (Feistel):", flush=True)
    first = first_batches(args)
    print(f"resize at {args.size:,} samples, survivor plan() vs Horovod reset():", flush=True)
    resize = child(["--child", "resize", "--size", str(args.size), "--reps", str(args.reps), "--inner",
                          str(args.inner)])
    resize_memory = {s: child(["--child", "resize-memory", "--size", str(args.size), "--system", s])
                     for s in ("elastic_ext", "horovod")}
    print("shuffle quality:", flush=True)
    quality = partition_quality.check(old_epoch_order, args.sizes, min(args.old_max_size, OLD_QUALITY_MAX_SIZE))
    t = {k: harness.summary(v) for k, v in resize["times_s"].items()}
    new_times = {s: r["new"]["time_s"]["median"] for s, r in first.items()}
    new_peaks = {s: r["new"]["memory"]["tracemalloc_peak"] for s, r in first.items()}
    data = {
        "benchmark": NAME,
        "command": " ".join([".venv/bin/python -m bench.partition", *argv]).strip(),
        "machine": info,
        "scenario": {"batch_per_rank": BATCH, "old_world": OLD_WORLD, "new_world": NEW_WORLD,
                     "consumed_fraction": CONSUMED, "newcomer_rank": RANK, "policy": "pad", "seed": SEED,
                     "sizes": args.sizes, "old_max_size": args.old_max_size, "reps": args.reps},
        "first_batch": first,
        "resize": {"size": args.size, "cursor": resize["cursor"], "times_s": t, "samples_s": resize["times_s"],
                   "memory_bytes": resize_memory, "correctness": resize["correctness"],
                   "horovod_world_size": resize["horovod_world_size"],
                   "ratio_survivor_plan_over_horovod_reset": t["survivor_plan"]["median"] / t["horovod_reset"]["median"]},
        "quality": quality,
        "targets": {
            "first_batch_at_most_s": FIRST_BATCH_TARGET_S,
            "first_batch_met": all(v <= FIRST_BATCH_TARGET_S for v in new_times.values()),
            "memory_independent_of_size": max(new_peaks.values()) <= 2 * min(new_peaks.values()),
            "resize_at_most_s": RESIZE_TARGET_S,
            "resize_met": t["survivor_plan"]["median"] <= RESIZE_TARGET_S,
        },
    }
    harness.write_json(args.name, data)
    rows = []
    for size, row in first.items():
        for system in ("old", "new"):
            if system in row:
                r = row[system]
                rows.append([f"{int(size):,}", system + (" (extrapolated)" if r.get("extrapolated") else ""),
                             r["time_s"]["median"] * 1e3, r["memory"]["tracemalloc_peak"] / harness.MIB,
                             r["memory"]["rss_peak"] / harness.MIB])
    print(harness.table(["samples", "first batch", "median ms", "tracemalloc peak MiB", "RSS peak MiB"], rows))
    print(harness.table(["resize at %s" % f"{args.size:,}", "median ms", "min ms"],
                        [[k, v["median"] * 1e3, v["min"] * 1e3] for k, v in t.items()]))
    print("\n".join(partition_quality.summary_lines(quality)))
    print(json.dumps({"targets": data["targets"]}))
    plot(data, args.name)
    return 0


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="epoch sizes for the first-batch comparison (default %(default)s)")
    parser.add_argument("--old-max-size", type=int, default=OLD_MAX_SIZE,
                        help="largest size the old order is built at; above it, extrapolated (default %(default)s)")
    parser.add_argument("--size", type=int, default=SIZE, help="epoch size of the resize comparison with Horovod")
    parser.add_argument("--reps", type=int, default=3, help="timed first batches and Horovod resets per size")
    parser.add_argument("--inner", type=int, default=50, help="survivor plan() calls timed per rep")
    parser.add_argument("--name", default=NAME, help="result file stem under bench/results (default %(default)s)")
    parser.add_argument("--child", choices=("first-time", "first-memory", "resize", "resize-memory"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    children = {"first-time": lambda: child_first_batch_time(args.size, args.reps, args.old),
                "first-memory": lambda: child_first_batch_memory(args.size, args.system),
                "resize": lambda: child_resize(args.size, args.reps, args.inner),
                "resize-memory": lambda: child_resize_memory(args.size, args.system)}
    if args.child:
        print(json.dumps(children[args.child]()))
        return 0
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

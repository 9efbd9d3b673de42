"""Re-partitioning: elastic_ext's ElasticPartitioner against Horovod's ElasticSampler.

Issue target: re-partitioning a 10-million-sample epoch after a resize takes
at most 50 ms, and its memory is reported, side by side with Horovod's
``ElasticSampler`` on the same input.

Run from the repository root::

    .venv/bin/python -m bench.partition

The scenario: an epoch of 10,000,000 samples, shuffled, 256 samples per rank
per step, 8 workers; 37% of the epoch is consumed (whole global steps), then
the job shrinks to 6 workers.

- elastic_ext: :class:`elastic_ext.ElasticPartitioner` with a ``world=``
  callable (no Horovod needed). A *survivor* keeps its partitioner across the
  resize, so the epoch order is cached and ``plan()`` is all it runs. A
  *newcomer* restores the committed position (``load_state_dict``) and must
  compute the epoch order from scratch: both are timed. ``plan()`` returns a
  view; materialising this rank's index array is timed as well.
- Horovod: ``horovod.torch.elastic.ElasticSampler`` over a dataset of 10M
  items, with ``processed_num`` at the same count (``record_batch`` per
  step), then ``reset()``, the method its resize path runs. Horovod is
  initialised for real with ``hvd.init()`` in one process, so ``reset()``
  sees a world of one. Its cost does not depend on the world size: it builds
  and shuffles a Python list of all 10M indices whatever the size, and the
  size only enters in a ceiling division. ``list(iter(sampler))`` (this
  rank's indices) is timed too; at a world of one that is all 6.3M remaining
  indices, more than a rank of six would copy, so that figure favours us.

Time: one process alternates the two systems. Memory: a fresh process per
system (RSS and its peak from ``/proc/self/status``; for elastic_ext also the
``tracemalloc`` peak, which sees numpy's allocations; for Horovod tracemalloc
would slow its 10M Python ints about fivefold, so RSS only).

Correctness side-check: after the resize the plans of all 6 ranks together
hold every unconsumed position of the epoch exactly once (policy ``"pad"``:
non-padding entries), and a newcomer's plan equals a survivor's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from bench import common

NAME = "partition"
TIME_TARGET_S = 0.050
SIZE = 10_000_000
BATCH = 256           # per rank per step
OLD_WORLD, NEW_WORLD = 8, 6
CONSUMED = 0.37
SEED = 0


def consumed_steps(size: int) -> int:
    """Whole global steps at the old world size that make about CONSUMED of the epoch."""
    return int(size * CONSUMED) // (BATCH * OLD_WORLD)


class World:
    """A mutable (rank, size), handed to the partitioner as its ``world=`` callable."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def __call__(self) -> Tuple[int, int]:
        return self.rank, self.size


class Items:
    """A dataset of ``n`` items; Horovod's sampler only calls ``len()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


# ----------------------------------------------------------------- elastic_ext

def survivor(size: int, policy: str = "pad"):
    """A partitioner that trained at 8 workers up to the cursor, then saw the world shrink to 6."""
    from elastic_ext import ElasticPartitioner

    world = World(0, OLD_WORLD)
    sampler = ElasticPartitioner(size, batch_size=BATCH, seed=SEED, policy=policy, world=world)
    sampler.set_epoch(0)
    sampler.plan()                      # the epoch started at 8 workers: the order is cached
    for _ in range(consumed_steps(size)):
        sampler.record_step()
    world.size = NEW_WORLD
    sampler.on_world_change()
    return sampler, world


def newcomer(size: int, committed: dict, rank: int):
    """A fresh process's partitioner after ``sync()`` loaded the committed position."""
    from elastic_ext import ElasticPartitioner

    sampler = ElasticPartitioner(size, batch_size=BATCH, seed=SEED, policy="pad", world=World(rank, NEW_WORLD))
    sampler.load_state_dict(committed)
    return sampler


def check_plans(sampler, world: World) -> Dict[str, Any]:
    """Asserts that the 6 ranks' plans hold every unconsumed position exactly once.

    Raises:
        AssertionError: a position is missing, repeated, or already consumed.
    """
    order, cursor = sampler.order(), sampler.cursor
    taken = []
    padding = 0
    for rank in range(NEW_WORLD):
        world.rank = rank
        plan = sampler.plan()
        taken.append(plan.indices[~plan.pad])
        padding += int(plan.pad.sum())
        if rank == 0:
            steps = plan.steps
    world.rank = 0
    taken_all = np.concatenate(taken)
    expected = np.sort(order[cursor:])
    if taken_all.shape != expected.shape or not np.array_equal(np.sort(taken_all), expected):
        raise AssertionError("the plans after the resize do not cover the unconsumed positions exactly once")
    consumed = np.zeros(sampler.size, dtype=bool)
    consumed[order[:cursor]] = True
    if consumed[taken_all].any():
        raise AssertionError("a plan after the resize hands out an already consumed position")
    return {"ranks": NEW_WORLD, "positions": int(taken_all.size), "unconsumed": int(expected.size),
            "padding_entries": padding, "steps_left": steps, "ok": True}


# --------------------------------------------------------------------- Horovod

def horovod_sampler(size: int):
    """Horovod's sampler with the same processed count as the cursor (world of one)."""
    from horovod.torch.elastic import ElasticSampler

    sampler = ElasticSampler(Items(size), shuffle=True, seed=SEED)
    # At a world of one, record_batch counts batch_size * 1; pass the old global batch.
    for step in range(consumed_steps(size)):
        sampler.record_batch(step, BATCH * OLD_WORLD)
    return sampler


def _init_horovod() -> None:
    import horovod.torch as hvd
    hvd.init()


# --------------------------------------------------------------------- children

def _timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def child_time(args: argparse.Namespace) -> Dict[str, Any]:
    _init_horovod()
    size = args.size
    ours, world = survivor(size)
    correctness = check_plans(ours, world)
    # The default policy: the epoch's last partial step is dropped, and plan() is a view.
    ours_drop, _ = survivor(size, "drop")
    committed = ours.state_dict()
    survivor_plan = ours.plan()
    theirs = horovod_sampler(size)

    times: Dict[str, List[float]] = {k: [] for k in ("ours_plan", "ours_plan_materialised", "ours_plan_drop",
                                                     "ours_newcomer",
                                                     "horovod_reset", "horovod_reset_iter")}
    for rep in range(args.reps):
        # Alternate who goes first; each call is timed on its own.
        for side in (("ours", "horovod") if rep % 2 == 0 else ("horovod", "ours")):
            gc.collect()
            if side == "ours":
                for _ in range(args.inner):
                    times["ours_plan"].append(_timed(ours.plan)[0])
                for _ in range(args.inner):
                    times["ours_plan_drop"].append(_timed(ours_drop.plan)[0])
                for _ in range(args.inner):
                    times["ours_plan_materialised"].append(
                        _timed(lambda: np.ascontiguousarray(ours.plan().indices))[0])
                fresh = newcomer(size, committed, rank=0)
                seconds, plan = _timed(fresh.plan)
                times["ours_newcomer"].append(seconds)
                if not (np.array_equal(plan.indices, survivor_plan.indices)
                        and np.array_equal(plan.pad, survivor_plan.pad)):
                    raise AssertionError("a newcomer's plan differs from a survivor's for the same rank")
                del fresh, plan
            else:
                seconds, _ = _timed(theirs.reset)
                times["horovod_reset"].append(seconds)
                iter_s, indices = _timed(lambda: list(iter(theirs)))
                times["horovod_reset_iter"].append(seconds + iter_s)
                if len(theirs.remaining_indices) != size - committed["cursor"]:
                    raise AssertionError(f"Horovod kept {len(theirs.remaining_indices)} indices after reset(), "
                                         f"expected {size - committed['cursor']}")
                del indices
    return {"times_s": times, "correctness": correctness, "horovod_world_size": _horovod_size(),
            "cursor": committed["cursor"], "horovod_processed_num": theirs.processed_num,
            "plan_shape": list(survivor_plan.indices.shape)}


def _horovod_size() -> int:
    import horovod.torch as hvd
    return hvd.size()


def _measure(fn: Callable[[], Any], trace: bool) -> Tuple[Dict[str, int], Any]:
    """RSS growth kept, RSS peak, and (optionally) the tracemalloc peak of one call."""
    gc.collect()
    common.malloc_trim()
    before = common.proc_memory()["rss"]
    common.reset_peak()
    if trace:
        tracemalloc.start()
    value = fn()
    out = {}
    if trace:
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.update(tracemalloc_current=current, tracemalloc_peak=peak)
    now = common.proc_memory()
    out.update(rss_kept=now["rss"] - before, rss_peak=now["peak"] - before)
    return out, value


def child_memory(args: argparse.Namespace) -> Dict[str, Any]:
    size = args.size
    if args.system == "horovod":
        _init_horovod()
    import elastic_ext  # noqa: F401  (module code is not the sampler's memory)
    gc.collect()
    common.malloc_trim()
    start = common.proc_memory()["rss"]
    if args.system == "elastic_ext":
        ours, world = survivor(size)
        committed = ours.state_dict()
        plan_mem, plan = _measure(ours.plan, trace=True)
        # What a survivor holds after the resize: the cached order and the new plan.
        held = _held(start)
        mat_mem, rows = _measure(lambda: np.ascontiguousarray(ours.plan().indices), trace=True)
        del ours, plan
        drop, _ = survivor(size, "drop")
        drop_mem, _ = _measure(drop.plan, trace=True)
        del drop
        new_mem, fresh = _measure(lambda: newcomer(size, committed, 0).plan(), trace=True)
        return {"held_after_resize": held, "plan": plan_mem, "plan_materialised": mat_mem, "plan_drop": drop_mem,
                "newcomer": new_mem,
                "materialised_bytes": int(rows.nbytes), "order_bytes": size * np.dtype(np.int32).itemsize}
    theirs = horovod_sampler(size)
    reset_mem, _ = _measure(theirs.reset, trace=False)
    # What the sampler holds after the resize: remaining_indices, a list of Python ints.
    held = _held(start)
    iter_mem, indices = _measure(lambda: list(iter(theirs)), trace=False)
    return {"held_after_resize": held, "reset": reset_mem, "iter": iter_mem, "rank_indices": len(indices)}


def _held(start: int) -> int:
    gc.collect()
    common.malloc_trim()
    return common.proc_memory()["rss"] - start


# ----------------------------------------------------------------------- driver

def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=SIZE, help="samples per epoch (default %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="Horovod resets and newcomer plans timed")
    parser.add_argument("--inner", type=int, default=50, help="survivor plan() calls timed per rep")
    parser.add_argument("--child", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=("elastic_ext", "horovod"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "time":
        print(json.dumps(child_time(args)))
        return 0
    if args.child == "memory":
        print(json.dumps(child_memory(args)))
        return 0
    return drive(args, argv)


def drive(args: argparse.Namespace, argv: List[str]) -> int:
    info = common.machine()
    size = ["--size", str(args.size)]
    memory = {s: common.run_child("bench.partition", ["--child", "memory", "--system", s, *size], timeout_s=300)
              for s in ("elastic_ext", "horovod")}
    timing = common.run_child("bench.partition", ["--child", "time", "--reps", str(args.reps), "--inner",
                                                  str(args.inner), *size], timeout_s=600)
    t = {k: common.summary(v) for k, v in timing["times_s"].items()}
    med = lambda key: t[key]["median"]
    ratios = {
        "survivor_plan_over_horovod_reset": med("ours_plan") / med("horovod_reset"),
        "survivor_materialised_over_horovod_reset_iter": med("ours_plan_materialised") / med("horovod_reset_iter"),
        "newcomer_over_horovod_reset": med("ours_newcomer") / med("horovod_reset"),
        "held_after_resize": memory["elastic_ext"]["held_after_resize"] / memory["horovod"]["held_after_resize"],
        "newcomer_rss_peak_over_horovod_reset_rss_peak":
            memory["elastic_ext"]["newcomer"]["rss_peak"] / memory["horovod"]["reset"]["rss_peak"],
    }
    targets = {
        "at_most_s": TIME_TARGET_S,
        "survivor_met": max(med("ours_plan"), med("ours_plan_materialised"), med("ours_plan_drop")) <= TIME_TARGET_S,
        "newcomer_met": med("ours_newcomer") <= TIME_TARGET_S,
        "horovod_reset_met": med("horovod_reset") <= TIME_TARGET_S,
    }
    data = {
        "benchmark": NAME,
        "command": " ".join([".venv/bin/python -m bench.partition", *argv]).strip(),
        "machine": info,
        "scenario": {"size": args.size, "batch_per_rank": BATCH, "old_world": OLD_WORLD, "new_world": NEW_WORLD,
                     "cursor": timing["cursor"], "consumed_fraction": timing["cursor"] / args.size,
                     "policy": "pad", "shuffle": True, "plan_shape_rank0": timing["plan_shape"],
                     "horovod_processed_num": timing["horovod_processed_num"],
                     "horovod_world_size": timing["horovod_world_size"]},
        "reps": args.reps, "inner": args.inner,
        "times_s": t, "samples_s": timing["times_s"], "memory_bytes": memory,
        "correctness": timing["correctness"], "ratios_elastic_ext_over_horovod": ratios, "targets": targets,
    }
    common.write_json(NAME, data)

    mo, mh = memory["elastic_ext"], memory["horovod"]
    mib = lambda b: b / common.MIB
    rows = [
        ["elastic_ext survivor: plan()", med("ours_plan") * 1e3, t["ours_plan"]["min"] * 1e3,
         mib(mo["plan"]["tracemalloc_peak"]), mib(mo["plan"]["rss_peak"]), mib(mo["plan"]["rss_kept"])],
        ["elastic_ext survivor: plan() + indices array", med("ours_plan_materialised") * 1e3,
         t["ours_plan_materialised"]["min"] * 1e3, mib(mo["plan_materialised"]["tracemalloc_peak"]),
         mib(mo["plan_materialised"]["rss_peak"]), mib(mo["plan_materialised"]["rss_kept"])],
        ["elastic_ext survivor: plan(), policy drop", med("ours_plan_drop") * 1e3, t["ours_plan_drop"]["min"] * 1e3,
         mib(mo["plan_drop"]["tracemalloc_peak"]), mib(mo["plan_drop"]["rss_peak"]), mib(mo["plan_drop"]["rss_kept"])],
        ["elastic_ext newcomer: order + plan()", med("ours_newcomer") * 1e3, t["ours_newcomer"]["min"] * 1e3,
         mib(mo["newcomer"]["tracemalloc_peak"]), mib(mo["newcomer"]["rss_peak"]), mib(mo["newcomer"]["rss_kept"])],
        ["horovod: reset()", med("horovod_reset") * 1e3, t["horovod_reset"]["min"] * 1e3, None,
         mib(mh["reset"]["rss_peak"]), mib(mh["reset"]["rss_kept"])],
        ["horovod: reset() + list(iter())", med("horovod_reset_iter") * 1e3, t["horovod_reset_iter"]["min"] * 1e3,
         None, mib(mh["reset"]["rss_peak"] + max(0, mh["iter"]["rss_peak"])),
         mib(mh["reset"]["rss_kept"] + mh["iter"]["rss_kept"])],
    ]
    print(f"{args.size:,} samples, {BATCH}/rank/step, {OLD_WORLD} -> {NEW_WORLD} workers at cursor "
          f"{timing['cursor']:,} ({timing['cursor'] / args.size:.1%}); {info['cpus']} CPUs, load "
          f"{info['load_average_at_start'][0]:.2f}; Horovod world size {timing['horovod_world_size']}")
    print(common.table(["path", "median ms", "min ms", "tracemalloc peak MiB", "RSS peak MiB", "RSS kept MiB"], rows))
    print(f"held after the resize (RSS over the process before the sampler existed): elastic_ext survivor "
          f"{mib(mo['held_after_resize']):.1f} MiB (order + plan), horovod {mib(mh['held_after_resize']):.1f} MiB "
          f"(remaining_indices)")
    c = timing["correctness"]
    print(f"check: {c['ranks']} plans cover all {c['unconsumed']:,} unconsumed positions exactly once "
          f"(+{c['padding_entries']} padding); newcomer plan == survivor plan")
    print(f"ratio elastic_ext/horovod (median time): survivor plan {ratios['survivor_plan_over_horovod_reset']:.2e}, "
          f"newcomer {ratios['newcomer_over_horovod_reset']:.3f}; target <= {TIME_TARGET_S * 1e3:.0f} ms: survivor "
          f"{'met' if targets['survivor_met'] else 'MISSED'}, newcomer {'met' if targets['newcomer_met'] else 'MISSED'}")

    labels = ["elastic_ext\nsurvivor", "elastic_ext\nnewcomer", "horovod\nreset()"]
    common.bar_chart(NAME, f"Re-partitioning {args.size / 1e6:g}M samples, {OLD_WORLD} -> {NEW_WORLD} workers, "
                           f"CPU ({info['cpus']} cores)", [
        {"ylabel": "median time (ms, log)", "labels": labels, "log": True,
         "values": [med("ours_plan") * 1e3, med("ours_newcomer") * 1e3, med("horovod_reset") * 1e3],
         "target": TIME_TARGET_S * 1e3, "target_label": "50 ms"},
        {"ylabel": "RSS peak (MiB)", "labels": labels,
         "values": [max(mib(mo["plan"]["rss_peak"]), 0.0), mib(mo["newcomer"]["rss_peak"]), mib(mh["reset"]["rss_peak"])]},
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

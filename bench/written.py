"""Commit and rollback that move only the pages written since, against whole copies.

``elastic_ext.state.written`` lets a commit or a rollback of a large CPU
tensor copy only the pages a step wrote since the commit (the kernel's
asynchronous write protection, Linux 6.7). This measures what it saves where
steps write little of a large state, and what it costs where they write all
of it. Run from the repository root::

    .venv/bin/python -m bench.written

Two cases, each in fresh processes (a world of one, ``hvd.init()``):

- ``table``: the small MLP with Adam and a float32 table of ``--table-mib``
  (432 by default) in the State, of which each step adds 1 to a 4 MiB slice
  (``bench.recovery``'s ``table`` model);
- ``dense``: an MLP of two 4096 x 4096 layers (64 MiB tensors) with Adam,
  whose every step writes every parameter and moment.

Each process runs ``--rounds`` rounds: 10 steps, ``State.commit()``, 5
steps, ``State.restore()``, timing the commit, the restore and the first
step after each commit, and checking after every restore that the table and
the parameters equal their values at the commit, bit for bit. The baseline
(``whole``) runs the same code with the threshold raised above every tensor,
so that every copy is whole, as before the write tracking. Processes run
whole, tracked, tracked, whole per case; the first round of each process is
reported apart (the tracked one registers its memory and, in ``dense``,
pays each page's first fault).

Writes ``bench/results/written.json`` (``--name``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List

from bench import harness

NAME = "written"
MODES = ("whole", "tracked")
CASES = ("table", "dense")
SLICE_BYTES = 4 << 20
STEPS_BEFORE_COMMIT = 10
STEPS_BEFORE_RESTORE = 5
PHASES = ("commit_s", "restore_s", "step_after_commit_s")


def child(args: argparse.Namespace) -> Dict[str, Any]:
    """One process: ``args.rounds`` rounds of ``args.case`` with every copy ``args.mode``."""
    import horovod.torch as hvd
    import torch

    import elastic_ext
    from bench.models import mlp
    from elastic_ext.state import written

    hvd.init()
    if args.mode == "whole":
        written.MIN_BYTES = 1 << 62  # the baseline: no tensor is large enough to be watched
    torch.manual_seed(0)
    if args.case == "table":
        model = mlp([64, 256, 10])
        table = torch.rand((args.table_mib << 20) // 4)
    else:
        model = mlp([4096, 4096, 4096], activation="GELU")
        table = None
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    objects = {"model": model, "optimizer": optimizer, "step": 0}
    state = elastic_ext.State(**objects, **({} if table is None else {"table": table}))
    width = 64 if args.case == "table" else 4096
    slice_elems = SLICE_BYTES // 4

    def step() -> None:
        loss = model(torch.randn(32, width)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if table is not None:
            start = (state.step * slice_elems) % (table.numel() - slice_elems)
            table[start:start + slice_elems].add_(1.0)
        state.step += 1

    rounds: List[Dict[str, float]] = []
    for _ in range(args.rounds):
        for _ in range(STEPS_BEFORE_COMMIT):
            step()
        commit_s, _ = harness.timed(state.commit)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_table = table.clone() if table is not None else None
        first_s, _ = harness.timed(step)
        for _ in range(STEPS_BEFORE_RESTORE - 1):
            step()
        restore_s, _ = harness.timed(state.restore)
        for key, value in model.state_dict().items():
            if not torch.equal(value, expected[key]):
                raise AssertionError(f"{args.case}/{args.mode}: the rollback did not bring back {key}")
        if table is not None and not torch.equal(table, expected_table):
            raise AssertionError(f"{args.case}/{args.mode}: the rollback did not bring back the table")
        rounds.append({"commit_s": commit_s, "restore_s": restore_s, "step_after_commit_s": first_s})
    return {"rounds": rounds}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-mib", type=int, default=432)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per process (at least 2)")
    parser.add_argument("--name", default=NAME)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.table_mib < 64:
        parser.error(f"--rounds {args.rounds} and --table-mib {args.table_mib}: expected at least 2 rounds and "
                     "a table of at least 64 MiB (smaller tensors are never watched)")
    if args.child:
        args.case, args.mode = args.child
        print(json.dumps(child(args)))
        return 0
    samples: Dict[str, Dict[str, List[Dict[str, float]]]] = {c: {m: [] for m in MODES} for c in CASES}
    for case in CASES:
        for mode in ("whole", "tracked", "tracked", "whole"):
            out = harness.run_child("bench.written", ["--child", case, mode, "--rounds", str(args.rounds),
                                                      "--table-mib", str(args.table_mib)], timeout_s=900)
            samples[case][mode].append(out["rounds"])
    medians: Dict[str, Dict[str, Dict[str, float]]] = {}
    rows = []
    for case in CASES:
        medians[case] = {}
        for mode in MODES:
            runs = samples[case][mode]
            later = [r for run in runs for r in run[1:]]
            first = [run[0] for run in runs]
            medians[case][mode] = {p: harness.median([r[p] for r in later]) for p in PHASES}
            medians[case][mode].update({f"first_{p}": harness.median([r[p] for r in first]) for p in PHASES})
        for phase in [*PHASES, *(f"first_{p}" for p in PHASES)]:
            whole, tracked = medians[case]["whole"][phase], medians[case]["tracked"][phase]
            rows.append([case, phase, whole, tracked, harness.ratio(tracked, whole)])
    print(harness.table(["case", "median (s)", "whole", "tracked", "tracked / whole"], rows))
    path = harness.write_json(args.name, {
        "machine": harness.machine(table_mib=args.table_mib, rounds=args.rounds),
        "samples": samples, "medians": medians,
        "tracked_over_whole": {case: {p: harness.ratio(medians[case]["tracked"][p], medians[case]["whole"][p])
                                      for p in medians[case]["whole"]} for case in CASES}})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

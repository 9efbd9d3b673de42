"""A ledger of processed samples, to prove (or disprove) exactly-once.

Each worker appends one JSON line per step to its own file: the generation
(``state.generation``, +1 per reset, the same on every rank), the epoch and
cursor the step started from, and the sample indices it processed. At each
(re)start it appends the position it resumed from. A reader then rebuilds the
*committed history*: for generation g, the steps between g's start position
and the position generation g+1 resumed from (g's last commit, as chosen by
sync). Steps a rollback threw away drop out; everything left must cover each
sample exactly once per epoch. A numeric rollback's skipped samples are
written as ``skipped`` records (:meth:`Ledger.skipped`): the audit counts
them as accounted for, once, and reports them per epoch.
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from elastic_ext.events import NUMERIC_ROLLBACK
from elastic_ext.config import ENV_RESTART

RESTART_STRIDE = 1_000_000  # generations of restart k are read as k * RESTART_STRIDE + generation
from elastic_ext.data.permutation import epoch_order


class Ledger:
    """Appends this process's steps to ``<directory>/steps-<pid>.jsonl`` (line-buffered)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._file = open(os.path.join(directory, f"steps-{os.getpid()}.jsonl"), "a", buffering=1,
                          encoding="utf-8")
        self._rollbacks_written = 0  # numeric_rollback events already written as skipped records
        # Under python -m elastic_ext.launch.supervise: which restart of the whole job this process belongs to.
        self._restart = int(os.environ.get(ENV_RESTART, "0") or 0)

    def start(self, generation: int, epoch: int, cursor: int, step: int, rank: int, size: int) -> None:
        self._write({"start": generation, "epoch": epoch, "cursor": cursor, "step": step, "rank": rank,
                     "size": size, "t": time.time()})

    def step(self, generation: int, epoch: int, cursor: int, step: int, rank: int, size: int,
             indices: Sequence[int], pads: int = 0) -> None:
        self._write({"gen": generation, "epoch": epoch, "cursor": cursor, "step": step, "rank": rank,
                     "size": size, "indices": [int(i) for i in indices], "pads": int(pads), "t": time.time()})

    def skipped(self, epoch: int, start: int, stop: int, indices: Sequence[int], reason: str, step: int,
                rank: int) -> None:
        """Positions ``[start, stop)`` of ``epoch`` (sample ``indices``) were skipped on purpose (``reason``)."""
        self._write({"skipped": [int(epoch), int(start), int(stop)], "epoch": int(epoch), "reason": reason,
                     "indices": [int(i) for i in indices], "step": int(step), "rank": int(rank), "t": time.time()})

    def skipped_by_rollbacks(self, events: Sequence[dict], sampler: Any, rank: int) -> None:
        """Writes a ``skipped`` record per range of each ``numeric_rollback`` event in ``events``
        not written yet (call it at the start of every generation with ``state.events.history``);
        the sample ids come from ``sampler``'s epoch order."""
        rollbacks = [e for e in events if e["event"] == NUMERIC_ROLLBACK]
        for event in rollbacks[self._rollbacks_written:]:
            for _name, epoch, start, stop in event["skipped"]:
                ids = epoch_order(sampler.size, sampler.seed, epoch, sampler.shuffle).take(np.arange(start, stop))
                self.skipped(epoch, start, stop, ids, event["reason"], event["step"], rank)
        self._rollbacks_written = len(rollbacks)

    def end(self, step: int, rank: int, size: int) -> None:
        self._write({"end": True, "step": step, "rank": rank, "size": size})

    def _write(self, record: dict) -> None:
        if self._restart:
            record["restart"] = self._restart
        self._file.write(json.dumps(record) + "\n")


def read(directory: str) -> List[dict]:
    """All records of all processes; a line cut by a SIGKILL is skipped.

    A restarted job (``restart`` > 0, see :mod:`elastic_ext.launch.supervise`)
    numbers its generations from its checkpoint's again, which may repeat
    those the dead job reached after that checkpoint; its generations are
    read as ``restart * RESTART_STRIDE + generation`` so they come after.
    The same happens inside one job when every worker holding the commit
    died and the next round resumed from the checkpoint (workers restarted
    in place, new workers in the dead ones' slots): see :func:`split_cohorts`.
    """
    files = []
    for path in sorted(glob.glob(os.path.join(directory, "steps-*.jsonl"))):
        records = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                for key in ("gen", "start"):
                    if key in record and record.get("restart"):
                        record[key] += record["restart"] * RESTART_STRIDE
                records.append(record)
        files.append(records)
    split_cohorts(files)
    return [record for records in files for record in records]


COHORT_GAP_S = 1.0  # a generation begun again by new processes starts at least this long after the last one died
COHORTS = 1000      # cohort k of generation g is read as g + k / COHORTS


def split_cohorts(files: List[List[dict]]) -> None:
    """Gives a generation that two sets of processes began one after the other two keys (in place).

    ``files``: each process's records. When every worker holding the commit
    dies, the next round resumes from the newest checkpoint and takes the
    generation after the checkpoint's, which the dead workers may already
    have begun and trained in. Both began at the same position, so the
    dead ones' steps would read as part of the committed history. The
    processes that began a generation are split into cohorts whose time
    spans (start record to last record) overlap; a cohort that starts more
    than :data:`COHORT_GAP_S` after every earlier one ended (a new set of
    processes has to start Python, its framework and a round first) is read
    as generation ``g + k / COHORTS``: after the first, before ``g + 1``.
    """
    spans: Dict[Any, List[Tuple[float, float, int]]] = {}
    for index, records in enumerate(files):
        first: Dict[Any, float] = {}
        last: Dict[Any, float] = {}
        for record in records:
            gen = record.get("gen", record.get("start"))
            if gen is None or "t" not in record:
                continue
            first.setdefault(gen, record["t"])
            last[gen] = record["t"]
        for gen, began in first.items():
            spans.setdefault(gen, []).append((began, last[gen], index))
    cohort_of: Dict[Tuple[int, Any], int] = {}
    for gen, members in spans.items():
        cohort, reach = 0, None
        for began, ended, index in sorted(members):
            if reach is not None and began > reach + COHORT_GAP_S:
                cohort += 1
            reach = ended if reach is None else max(reach, ended)
            cohort_of[(index, gen)] = cohort
    for index, records in enumerate(files):
        for record in records:
            for key in ("gen", "start"):
                if key in record and cohort_of.get((index, record[key]), 0):
                    record[key] = record[key] + cohort_of[(index, record[key])] / COHORTS


def starts(records: Iterable[dict]) -> Dict[int, Tuple[int, int, int]]:
    """generation -> (epoch, cursor, step) it started from."""
    found: Dict[int, Tuple[int, int, int]] = {}
    for record in records:
        if "start" in record:
            found.setdefault(record["start"], (record["epoch"], record["cursor"], record["step"]))
    return found


def committed_history(records: List[dict]) -> List[dict]:
    """The step records whose effect is in the final state (see module docstring)."""
    begun = starts(records)
    gens = sorted(begun)
    history = []
    for i, gen in enumerate(gens):
        begin = begun[gen][:2]
        # The earliest position any later generation started from: a restarted
        # job may resume from a checkpoint older than the dead job's last start.
        end: Tuple[Any, Any] = min((begun[g][:2] for g in gens[i + 1:]), default=(float("inf"), 0))
        history.extend(r for r in records if r.get("gen") == gen and begin <= (r["epoch"], r["cursor"]) < end)
    return history


def audit(records: List[dict], dataset_size: int, epochs: int, history: Optional[List[dict]] = None) -> dict:
    """Counts, per epoch, samples processed twice and never in the committed history.

    Skipped samples (``skipped`` records, each range counted once however
    many ranks wrote it) count as accounted for; a sample both skipped and
    processed is duplicated. ``history``: the committed history when a
    system decides it otherwise than by generations and the positions they
    resume from (a peer that commits or discards each step on its own, such
    as torchft in bench/); by default :func:`committed_history`.

    Returns ``{"epochs": [{"epoch", "processed", "skipped", "duplicated",
    "missing", "duplicated_ids", "missing_ids"}], "lost_steps": steps thrown
    away by rollbacks, "exactly_once": bool}``.
    """
    history = committed_history(records) if history is None else history
    skips = {tuple(r["skipped"]): r["indices"] for r in records if "skipped" in r}
    report: Dict[str, Any] = {"epochs": []}
    ok = True
    for epoch in range(epochs):
        seen = [i for r in history if r["epoch"] == epoch for i in r["indices"]]
        dropped = [i for key, ids in sorted(skips.items()) if key[0] == epoch for i in ids]
        counts = np.bincount(np.asarray(seen + dropped, dtype=np.int64), minlength=dataset_size)
        twice = np.flatnonzero(counts > 1)
        never = np.flatnonzero(counts == 0)
        ok = ok and twice.size == 0 and never.size == 0
        report["epochs"].append({"epoch": epoch, "processed": int(len(seen)), "skipped": int(len(dropped)),
                                 "duplicated": int(twice.size),
                                 "missing": int(never.size), "duplicated_ids": twice[:20].tolist(),
                                 "missing_ids": never[:20].tolist()})
    all_steps = {(r["gen"], r["epoch"], r["cursor"]) for r in records if "gen" in r}
    kept = {(r["gen"], r["epoch"], r["cursor"]) for r in history}
    report["lost_steps"] = len(all_steps - kept)
    report["exactly_once"] = ok
    return report


def resumed_steps(records: List[dict]) -> List[Tuple[int, int, Optional[int]]]:
    """(generation, step it resumed from, highest step the previous generation reached)."""
    begun = starts(records)
    gens = sorted(begun)
    out = []
    for prev, nxt in zip(gens, gens[1:]):
        reached = max((r["step"] for r in records if r.get("gen") == prev), default=None)
        out.append((nxt, begun[nxt][2], reached))
    return out

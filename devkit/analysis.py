"""Reading what test workers wrote: committed history, final states, events.

Events are read with :func:`elastic_ext.events.read_events`, re-exported here.
"""

from __future__ import annotations

import glob
import os
from typing import Dict

import numpy as np

from elastic_ext.events import read_events
from devkit import ledger


def assert_exactly_once(out_dir: str, dataset_size: int, epochs: int) -> dict:
    report = ledger.audit(ledger.read(str(out_dir)), dataset_size, epochs)
    assert report["exactly_once"], f"not exactly once: {report['epochs']}"
    return report


def assert_no_step_went_back_past_a_commit(out_dir: str, commit_every: int) -> None:
    for gen, resumed, reached in ledger.resumed_steps(ledger.read(str(out_dir))):
        assert reached is None or resumed >= reached - commit_every, (
            f"generation {gen} resumed at step {resumed}, more than one commit interval ({commit_every}) "
            f"behind step {reached} reached before")


def load_finals(out_dir: str) -> Dict[int, Dict[str, np.ndarray]]:
    """``final-<rank>.npz`` of every rank: {rank: {name: array}}."""
    finals = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "final-*.npz"))):
        rank = int(os.path.basename(path)[len("final-"):-len(".npz")])
        with np.load(path) as data:
            finals[rank] = {k: data[k].copy() for k in data.files}
    return finals


def assert_bitwise_equal(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: different keys {sorted(set(a) ^ set(b))}"
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"{what}: {key} shape/dtype"
        if a[key].tobytes() != b[key].tobytes():
            diff = np.abs(a[key].astype(np.float64) - b[key].astype(np.float64)).max()
            raise AssertionError(f"{what}: {key} differs (max abs diff {diff:.3g})")


def assert_ranks_identical(finals: Dict[int, Dict[str, np.ndarray]]) -> None:
    ranks = sorted(finals)
    assert ranks, "no final state was written"
    for rank in ranks[1:]:
        assert_bitwise_equal(finals[ranks[0]], finals[rank], f"rank {ranks[0]} vs rank {rank}")



__all__ = ["assert_exactly_once", "assert_no_step_went_back_past_a_commit", "load_finals", "assert_bitwise_equal",
           "assert_ranks_identical", "read_events"]

"""Tests read worker output through :mod:`devkit.analysis` (re-exported here),
and through the few readers below that only tests need."""

import os

from elastic_ext.checkpoint import MANIFEST_FILE, CheckpointStore, checkpoint_name
from devkit.analysis import *  # noqa: F401,F403


def durable_commit_ids(ckpt_dir):
    """The commit ids of the checkpoints in ``ckpt_dir`` whose manifest is written (a checkpoint
    is durable once its manifest is there), newest first; [] while the directory does not exist."""
    if not os.path.isdir(ckpt_dir):
        return []
    return [i for i in CheckpointStore(str(ckpt_dir)).commit_ids()
            if os.path.exists(os.path.join(ckpt_dir, checkpoint_name(i), MANIFEST_FILE))]


def sizes_by_generation(records):
    """The world sizes rank 0 recorded in each generation's steps, one sorted list per
    generation, oldest first (``records``: :func:`devkit.ledger.read`)."""
    by_gen = {}
    for r in records:
        if "gen" in r and r["rank"] == 0:
            by_gen.setdefault(r["gen"], set()).add(r["size"])
    return [sorted(by_gen[g]) for g in sorted(by_gen)]

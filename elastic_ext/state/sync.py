"""Sync and verify: who holds which commit, the root, the digest, the broadcasts.

``State.sync()`` runs these steps on every rank together:

1. Every rank allgathers one row of the *id table* (:func:`gather_ids`):
   commit id, survivor?, generation, digest of what must agree, digest of
   everything. The same collective whatever the rank's history, so survivors
   of a resize and newcomers filling a freed slot always meet.
2. :func:`choose_root` picks the newest commit among survivors (ids may be
   one apart after a failure mid-commit) and the lowest rank holding it.
3. :func:`check_agreement` raises :class:`StateDivergenceError` if a
   survivor at that commit differs from the root in something that must
   agree (see :func:`digest_items`); it names the first differing entry.
4. If every rank already holds exactly those bytes (:func:`all_agree`),
   nothing more is sent; otherwise the root broadcasts the commit's
   metadata, and every rank holding the root's bytes (:func:`holders`)
   sends one stripe of the arrays to the ranks that lack them.

The host-update allreduce of every commit, which also carries the commit
id, is in :mod:`elastic_ext.state.host_updates`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Protocol, Set, Tuple

import numpy as np

from elastic_ext.binding import Binding, broadcast_json, gather_striped, layout_sizes
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.digests import DigestItem, Digests, combine, digest_items
from elastic_ext.errors import CheckpointError, StateDivergenceError
from elastic_ext.events import SYNC, EventLog
from elastic_ext.state.host_updates import HostUpdates
from elastic_ext.state.records import CommitRecord, RollbackRecord
from elastic_ext.state.snapshot import Entry
from elastic_ext.state.tracked import Tracked


class Resumer(Protocol):
    """What a fresh job's sync asks of the root's checkpoint writer (:class:`elastic_ext.checkpoint.Checkpointer`).

    A Protocol rather than the class: the checkpoint package writes these
    buffers and so sits on top of this one, which must not import it back.
    """

    def newest(self, synced: Set[str]) -> Tuple[Optional[Any], Optional[str]]:
        """The newest valid checkpoint of these objects (entries, commit id, manifest, path), or (None, why)."""

    def resumed(self, loaded: Any) -> None:
        """Records that the job resumed from ``loaded``."""


# Columns of the id table, one row per rank.
ID, PARTICIPATED, GENERATION, DIGEST, FULL_DIGEST = range(5)

def gather_ids(binding: Binding, commit_id: int, participated: bool, generation: int,
               items: List[DigestItem]) -> np.ndarray:
    """The id table: every rank's ``(commit id, survivor?, generation, digest, full digest)``."""
    mine = np.array([[commit_id, int(participated), generation, combine(items, strict_only=True),
                      combine(items, strict_only=False)]], dtype=np.int64)
    return binding.allgather(mine, "elastic_ext.state.sync.ids")


def choose_root(table: np.ndarray) -> Tuple[int, int]:
    """The sync root and commit id: the newest commit among survivors, held by the lowest rank.

    Raises:
        StateDivergenceError: survivors' ids differ beyond what a failure mid-commit explains.
    """
    survivors = np.flatnonzero(table[:, PARTICIPATED] == 1)
    if survivors.size == 0:
        return 0, int(table[0, ID])
    ids = table[survivors, ID]
    newest, oldest = int(ids.max()), int(ids.min())
    if newest - oldest > 1:
        detail = ", ".join(f"rank {r}: {int(table[r, ID])}" for r in survivors)
        raise StateDivergenceError(f"surviving ranks hold commit ids {oldest}..{newest} ({detail}); "
                                   "ids may differ by at most 1 (a failure during commit)")
    return int(survivors[ids == newest][0]), newest


def all_agree(table: np.ndarray, root: int, target: int) -> bool:
    """True if every rank is a survivor holding commit ``target`` with the root's bytes and generation."""
    return bool(table[:, PARTICIPATED].all() and (table[:, ID] == target).all()
                and (table[:, FULL_DIGEST] == table[root, FULL_DIGEST]).all()
                and (table[:, GENERATION] == table[root, GENERATION]).all())


def check_agreement(binding: Binding, table: np.ndarray, root: int, target: int, items: List[DigestItem]) -> None:
    """Raises StateDivergenceError if survivors at ``target`` differ from the root in
    what must agree. Cheap unless they do: then one more broadcast and allgather
    find the first differing entry, on every rank together."""
    same = np.flatnonzero((table[:, PARTICIPATED] == 1) & (table[:, ID] == target))
    bad = [int(r) for r in same if table[r, DIGEST] != table[root, DIGEST]]
    if not bad:
        return
    first, differing = first_difference(binding, root, bad, items)
    what = (f"first difference: {first}" if first is not None
            else "the entries differ in which arrays they hold")
    raise StateDivergenceError(
        f"ranks {differing} hold commit {target} with different values than rank {root} in state that must "
        f"agree across ranks ({what}; checksums {int(table[bad[0], DIGEST]):#010x} vs "
        f"{int(table[root, DIGEST]):#010x}). Parameters, optimizer state, plain values and sampler "
        "positions must agree; buffers may differ. Mark an object that is legitimately per rank with "
        "State(..., per_rank=(name,))")


def first_difference(binding: Binding, root: int, bad: List[int],
                     items: List[DigestItem]) -> Tuple[Optional[str], List[int]]:
    """On every rank together (one broadcast and one allgather): the first entry that must agree
    in which some of the ranks ``bad`` differ from ``root``, and those ranks; (None, ``bad``)
    when the entries differ only in which arrays they hold."""
    b = binding
    labels = broadcast_json(b, [label for label, _, strict in items if strict] if b.rank() == root else None,
                            root, "elastic_ext.state.sync.diagnose.labels")
    crcs = dict((label, crc) for label, crc, strict in items if strict)
    row = np.array([[crcs.get(label, -1) for label in labels]], dtype=np.int64)
    found = b.allgather(row, "elastic_ext.state.sync.diagnose.digests") if labels else np.zeros((b.size(), 0))
    for column, label in enumerate(labels):
        ranks = [r for r in bad if found[r, column] != found[root, column]]
        if ranks:
            return label, ranks
    return None, bad


def holders(table: np.ndarray, root: int) -> List[int]:
    """The ranks that hold the root's commit bytes for bytes (survivors at its id, generation and
    full digest): they share the sending."""
    if not table[root, PARTICIPATED]:
        return [root]
    same = ((table[:, PARTICIPATED] == 1) & (table[:, ID] == table[root, ID])
            & (table[:, GENERATION] == table[root, GENERATION]) & (table[:, FULL_DIGEST] == table[root, FULL_DIGEST]))
    return [int(r) for r in np.flatnonzero(same)]


def layout(entries: Dict[str, Entry], names: List[str]) -> list:
    """``[[name/key, dtype, shape], ...]``: what :func:`~elastic_ext.binding.broadcast_arrays` sends."""
    return [[f"{name}/{key}", array.dtype.str, list(array.shape)]
            for name in names for key, array in entries[name].arrays.items()]


def flat_arrays(entries: Dict[str, Entry], names: List[str]) -> Dict[str, np.ndarray]:
    return {f"{name}/{key}": array for name in names for key, array in entries[name].arrays.items()}


def arrays_of(name: str, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The received arrays of entry ``name`` (keys without the ``name/`` prefix)."""
    prefix = name + "/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


@dataclasses.dataclass
class Party:
    """Everything of one rank that a sync reads and updates."""

    binding: Binding
    tracked: Tracked
    buffers: CommitBuffers
    record: CommitRecord
    hosts: HostUpdates
    rollbacks: RollbackRecord
    events: EventLog
    checkpointer: Optional[Resumer]
    digests: Optional[Digests] = None


def sync(party: Party) -> None:
    """Makes every rank hold the same commit (see the module docstring); the caller
    has snapshotted a newcomer's objects first.

    Raises:
        StateDivergenceError: survivors disagree beyond what a failure explains.
        CheckpointError: a fresh job cannot resume from its checkpoints.
    """
    started, b, record, buffers = time.perf_counter(), party.binding, party.record, party.buffers
    names = party.tracked.synced(buffers.entries)
    items = digest_items(buffers.entries, names, {n: party.tracked.buffer_keys(n) for n in names}, party.digests)
    if party.digests is not None:
        party.digests.clear()
    table = gather_ids(b, record.commit_id, record.participated, record.generation, items)
    root, target = choose_root(table)
    check_agreement(b, table, root, target, items)
    if all_agree(table, root, target):  # everyone holds these bytes: nothing to send
        record.generation += 1
        party.events.emit(SYNC, commit_id=target, generation=record.generation, root=root, loaded=False,
                          newcomers=0, broadcast=False, bytes=0, duration_s=time.perf_counter() - started)
        return
    resume_error = None
    if party.checkpointer is not None and not table[:, PARTICIPATED].any() and b.rank() == root:
        resume_error = _resume(party, set(names))
        names = party.tracked.synced(buffers.entries)
    entries = buffers.entries
    meta = {"commit_id": record.commit_id, "names": names, "meta": {n: entries[n].meta for n in names},
            "layout": layout(entries, names), "last_updated_timestamp": party.hosts.last_timestamp,
            "rollbacks": party.rollbacks.to_json(), "generation": record.generation}
    if party.checkpointer is not None:
        meta["resume_error"] = resume_error
    meta = broadcast_json(b, meta, root, "elastic_ext.state.sync.meta")
    if meta.get("resume_error"):  # raised on every rank together, so none waits in a broadcast
        raise CheckpointError(meta["resume_error"])
    if "resume_error" in meta:
        target = int(meta["commit_id"])  # the checkpoint a fresh job resumed from, if any
    senders = holders(table, root)  # a fresh job's root alone (it may have loaded a checkpoint)
    arrays = gather_striped(b, flat_arrays(entries, names), meta["layout"], senders, "elastic_ext.state.sync.arrays")
    # Buffers (BatchNorm statistics) may differ: a rank loads unless its
    # *full* digest, buffers included, matches the root's.
    up_to_date = (record.participated and record.commit_id == target
                  and combine(items, strict_only=False) == int(table[root, FULL_DIGEST]))
    if b.rank() != root and not up_to_date:
        missing = set(meta["names"]) - set(party.tracked.objects)
        if missing:
            raise StateDivergenceError(f"the root commits objects {sorted(missing)} that this rank does "
                                       f"not track (this rank tracks {sorted(party.tracked.objects)})")
        for name in meta["names"]:
            party.tracked.apply(name, buffers.load(name, arrays_of(name, arrays), meta["meta"][name]))
    record.commit_id = target
    party.hosts.last_timestamp = meta["last_updated_timestamp"]
    party.rollbacks.load_json(meta["rollbacks"])
    record.generation = meta["generation"] + 1
    record.participated = True
    party.events.emit(SYNC, commit_id=target, generation=record.generation, root=root,
                      loaded=bool(b.rank() != root and not up_to_date), broadcast=True,
                      newcomers=int((table[:, PARTICIPATED] == 0).sum()), duration_s=time.perf_counter() - started,
                      bytes=sum(layout_sizes(meta["layout"])), senders=senders)


def _resume(party: Party, synced: set) -> Optional[str]:
    """On the root of a fresh job: loads the newest valid checkpoint; returns an error message or None."""
    loaded, error = party.checkpointer.newest(synced)
    if loaded is None:
        return error
    try:
        for name, entry in loaded.entries.items():
            party.buffers.entries[name] = entry
            party.tracked.apply(name, entry)
    except Exception as exc:  # noqa: BLE001 - every rank raises it as CheckpointError in sync()
        return f"cannot resume from checkpoint {loaded.path}: {type(exc).__name__}: {exc}"
    party.record.commit_id = loaded.commit_id
    party.record.generation = int(loaded.manifest.get("generation", 0))
    party.checkpointer.resumed(loaded)
    return None

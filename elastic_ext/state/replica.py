"""The replica check at a commit: each rank's digest on the commit's collective, and the heal.

With ``ElasticConfig.replica_check_every = N`` (> 0), every N-th commit
(by commit id) each rank digests what it just committed and must agree
across ranks (:func:`replica_digest`: the synced entries without their
buffers, so not BatchNorm statistics, and no per-rank object) and puts the
digest in its own slot of the commit's max-allreduce
(:mod:`elastic_ext.state.host_updates`): no collective of its own. Every
rank reads the same table and :func:`elastic_ext.policies.replica.judge`
gives every rank the same verdict. When ranks differ (:meth:`ReplicaCheck.act`,
on every rank together):

1. one allgather of the ranks' host names, and the diagnosis of the first
   entry that differs (:func:`elastic_ext.state.sync.first_difference`);
2. with a strict majority, the wrong ranks take the majority's commit: the
   lowest majority rank broadcasts the metadata, every majority rank sends
   one stripe of the arrays (:func:`elastic_ext.binding.gather_striped`, as a
   newcomer's sync), and the wrong ranks load them into their commit buffers
   and their live objects, keeping their own buffers (BatchNorm statistics);
3. a ``replica_mismatch`` event on every rank names the wrong ranks and hosts;
4. a host wrong twice within :data:`~elastic_ext.policies.replica.REPEAT_WINDOW_S`:
   its wrong ranks add it to ``exclude_file`` and ask to leave, which every
   rank agrees at the next commit (the leave path of SIGTERM);
5. without a strict majority (two ranks, a tie) every rank raises
   :class:`~elastic_ext.errors.StateDivergenceError` naming the last commit
   on which every rank agreed.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import xxhash

from elastic_ext.binding import Binding, broadcast_json, gather_striped, layout_sizes
from elastic_ext.errors import StateDivergenceError
from elastic_ext.events import REPLICA_MISMATCH, EventLog
from elastic_ext.policies.eviction import exclude_host, host_name
from elastic_ext.policies.replica import RepeatOffenders, ReplicaVerdict, describe, judge, pack_digest
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.snapshot import Entry
from elastic_ext.state.sync import INT63, arrays_of, digest_items, first_difference
from elastic_ext.state.tracked import Tracked

logger = logging.getLogger(__name__)

HOST_BYTES = 256  # a host name's width in the allgather of names (DNS names are at most 253)


def replica_digest(entries: Dict[str, Entry], names: List[str], keys: Dict[str, FrozenSet[str]]) -> int:
    """One 63-bit XXH3 over what must agree in ``entries[names]``: every entry's name and metadata, and
    every array but its buffers (``keys``) with its key, dtype and shape. One streaming hash: the
    per-entry digests and labels of :func:`~elastic_ext.state.sync.digest_items` are only computed
    when ranks differ, to name the entry."""
    digest = xxhash.xxh3_64()
    for name in names:
        entry = entries[name]
        digest.update(f"{name}\0{json.dumps(entry.meta, sort_keys=True)}\0".encode())
        skip = keys.get(name, frozenset())
        for key, array in entry.arrays.items():
            if key not in skip:
                digest.update(f"{key}\0{array.dtype.str}{array.shape}\0".encode())
                digest.update(np.ascontiguousarray(array).view(np.uint8).data)
    return digest.intdigest() & INT63


def gather_hosts(binding: Binding) -> List[str]:
    """Every rank's host name, in rank order (one allgather)."""
    name = host_name().encode()[:HOST_BYTES]
    row = np.zeros((1, HOST_BYTES), dtype=np.uint8)
    row[0, :len(name)] = np.frombuffer(name, dtype=np.uint8)
    table = binding.allgather(row, "elastic_ext.state.replica.hosts")
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in np.asarray(table, dtype=np.uint8)]


class ReplicaCheck:
    """One rank's part in the replica check (see the module docstring).

    Args:
        every: check every this many commits (by commit id); 0 turns it off.
        tracked: the State's objects and adapters.
        buffers: the State's commit buffers (what is digested and healed).
        events: the State's event log.
        exclude_file: where a host wrong twice is added (None: nowhere).
    """

    def __init__(self, every: int, tracked: Tracked, buffers: CommitBuffers, events: EventLog,
                 exclude_file: Optional[str] = None) -> None:
        self.every = every
        self.tracked = tracked
        self.buffers = buffers
        self.events = events
        self.exclude_file = exclude_file
        self.offenders = RepeatOffenders()
        self.last_agreed: Optional[int] = None  # the newest commit id on which every rank agreed
        self._digested: Optional[Tuple[List[str], Dict[str, FrozenSet[str]]]] = None

    def due(self, commit_id: int) -> bool:
        """True at the commits that are checked (the same on every rank: commit ids are agreed)."""
        return self.every > 0 and commit_id > 0 and commit_id % self.every == 0

    def slots(self, rank: int, size: int, commit_id: int) -> Optional[np.ndarray]:
        """This rank's part of the commit's max-allreduce at a checked commit (its digest), else None."""
        self._digested = None
        if not self.due(commit_id) or self.buffers.entries is None:
            return None
        names = self.tracked.synced(self.buffers.entries)
        keys = {name: self.tracked.buffer_keys(name) for name in names}
        self._digested = (names, keys)
        return pack_digest(rank, size, replica_digest(self.buffers.entries, names, keys))

    def act(self, reduced: np.ndarray, binding: Binding, commit_id: int, liveness: Any, term_grace_s: float) -> None:
        """Acts on the agreed table of digests (every rank together; collectives only when they differ).

        Raises:
            StateDivergenceError: the ranks differ and no strict majority tells the right state.
        """
        verdict = judge(reduced)
        if verdict.agreed:
            self.last_agreed = commit_id
            return
        names, keys = self._digested
        hosts = gather_hosts(binding)
        root = verdict.majority[0] if verdict.majority else min(set(range(len(hosts))) - set(verdict.wrong))
        first, _ = first_difference(binding, root, list(verdict.wrong), digest_items(self.buffers.entries, names, keys))
        fields = {"commit_id": commit_id, "wrong_ranks": list(verdict.wrong),
                  "wrong_hosts": [hosts[r] for r in verdict.wrong], "majority_ranks": list(verdict.majority),
                  "first_difference": first, "last_agreed_commit_id": self.last_agreed}
        if not verdict.healable:
            self.events.emit(REPLICA_MISMATCH, **fields, healed=False, bytes=0, senders=[], repeat_hosts=[])
            raise StateDivergenceError(self._no_majority(verdict, hosts, commit_id, first))
        sent, senders = heal(binding, self.tracked, self.buffers, names, keys, verdict)
        repeat = self.offenders.note([hosts[r] for r in verdict.wrong])
        rank = binding.rank()
        if rank in verdict.wrong and hosts[rank] in repeat:
            exclude_host(self.exclude_file, hosts[rank], "committed a corrupt replica twice")
            liveness.ask_to_leave(term_grace_s, cause="replica")
        self.events.emit(REPLICA_MISMATCH, **fields, healed=True, bytes=sent, senders=senders, repeat_hosts=repeat)

    def _no_majority(self, verdict: ReplicaVerdict, hosts: List[str], commit_id: int, first: Optional[str]) -> str:
        agreed = (f"the last commit on which every rank agreed is {self.last_agreed}" if self.last_agreed is not None
                  else "no earlier check agreed in this process")
        return (f"replica check at commit {commit_id}: ranks committed different states that must agree "
                f"(first difference: {first}; {describe(verdict, hosts)}) and no strict majority holds one of "
                f"them, so no rank can tell the right one (two ranks, or a tie): stopping rather than training "
                f"on a corrupt replica. {agreed}; resume from a checkpoint at or before it (later checkpoints "
                "were written by rank 0, which may hold the corrupt copy), and check the hosts named here")


def heal(binding: Binding, tracked: Tracked, buffers: CommitBuffers, names: List[str],
         keys: Dict[str, FrozenSet[str]], verdict: ReplicaVerdict) -> Tuple[int, List[int]]:
    """The wrong ranks take the majority's committed state (what must agree; their own buffers stay).

    Returns (bytes sent, the ranks that sent a stripe). Every rank calls it together.
    """
    rank, root, senders = binding.rank(), verdict.majority[0], list(verdict.majority)
    entries = buffers.entries
    mine = {f"{name}/{key}": array for name in names for key, array in entries[name].arrays.items()
            if key not in keys[name]}
    plan = None
    if rank == root:
        plan = {"names": names, "meta": {name: entries[name].meta for name in names},
                "layout": [[key, array.dtype.str, list(array.shape)] for key, array in mine.items()]}
    plan = broadcast_json(binding, plan, root, "elastic_ext.state.replica.meta")
    arrays = gather_striped(binding, mine, plan["layout"], senders, "elastic_ext.state.replica.arrays")
    if rank in verdict.wrong:
        for name in plan["names"]:
            own = entries[name].arrays if name in entries else {}
            merged = {key: array for key, array in own.items() if key in keys.get(name, frozenset())}
            merged.update(arrays_of(name, arrays))
            tracked.apply(name, buffers.load(name, merged, plan["meta"][name]))
        logger.warning("[rank %d] committed state differed from the majority's (ranks %s): replaced by theirs",
                       rank, list(verdict.majority))
    return sum(layout_sizes(plan["layout"])), senders

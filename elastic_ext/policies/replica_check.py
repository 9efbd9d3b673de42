"""The replica check at a commit: each rank's digest on the commit's collective, and the replay that explains a mismatch.

With ``ElasticConfig.replica_check_every = N`` (> 0), every N-th commit
(by commit id) each rank digests what it just committed and must agree
across ranks (:func:`replica_digest`: the synced entries without their
buffers, so not BatchNorm statistics, and no per-rank object) and puts the
digest in its own slot of the commit's max-allreduce
(:mod:`elastic_ext.state.host_updates`, through :meth:`ReplicaCheck.row`, its part
in the commit: :mod:`elastic_ext.state.commit_slots`): no collective of its own. Every
rank reads the same table and :func:`elastic_ext.policies.replica.judge`
gives every rank the same verdict. When ranks differ at commit c
(:meth:`ReplicaCheck.act`, on every rank together), nothing is healed yet:

1. one allgather of the ranks' host names and the diagnosis of the first
   entry that differs (:func:`elastic_ext.state.sync.first_difference`), a
   ``replica_replay`` event, then :class:`~elastic_ext.errors.ReplicaMismatchError`
   on every rank: ``run`` brings every rank back to the last commit a on
   which all agreed (kept in host memory, :mod:`elastic_ext.state.agreed`)
   and trains again to c, where the check runs whatever the cadence;
2. all agree at c now: the fault was transient (hardware: a flipped bit, a
   faulty core). ``replica_mismatch`` says ``cause: "transient"``, the job
   goes on from a replayed state that a failure-free run would hold, and
   the wrong ranks' hosts (named by a strict majority) get a strike; a host
   struck twice within :data:`~elastic_ext.policies.replica.REPEAT_WINDOW_S`
   adds itself to ``exclude_file`` and its wrong ranks leave at the next
   commit (the leave path of SIGTERM);
3. the same ranks differ again: the divergence is deterministic (an object
   whose restore lost a link, per-rank configuration, rank-dependent code),
   not hardware. ``replica_mismatch`` says ``cause: "divergence"`` and every
   rank raises :class:`~elastic_ext.errors.StateDivergenceError` naming the
   entry, the ranks and what was replayed; no host is struck.

A reset (a failure, a resize) ends a replay under way: the sync after it
gives every rank the same commit again, from which training goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import xxhash

from elastic_ext.binding import Binding
from elastic_ext.errors import ReplicaMismatchError, StateDivergenceError
from elastic_ext.events import REPLICA_MISMATCH, REPLICA_REPLAY, EventLog
from elastic_ext.policies.eviction import exclude_host, host_name
from elastic_ext.policies.replica import RepeatOffenders, ReplicaVerdict, describe, judge, pack_digest
from elastic_ext.state.agreed import AgreedCommit
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.commit_slots import CommitPoint
from elastic_ext.state.snapshot import Entry
from elastic_ext.state.digests import INT63, digest_items
from elastic_ext.state.sync import first_difference
from elastic_ext.state.tracked import Tracked

logger = logging.getLogger(__name__)

#: Replays of one mismatch that each found another one before the job stops (a fault that keeps
#: moving is no longer transient).
MAX_REPLAYS = 3

HOST_BYTES = 256  # a host name's width in the allgather of names (DNS names are at most 253)


def replica_digest(entries: Dict[str, Entry], names: List[str], keys: Dict[str, FrozenSet[str]]) -> int:
    """One 63-bit XXH3 over what must agree in ``entries[names]``: every entry's name and metadata, and
    every array but its buffers (``keys``) with its key, dtype and shape. One streaming hash: the
    per-entry digests and labels of :func:`~elastic_ext.state.digests.digest_items` are only computed
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
    # (the collective keeps the name it had when this module lived in state/: every rank must use the same one)
    table = binding.allgather(row, "elastic_ext.state.replica.hosts")
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in np.asarray(table, dtype=np.uint8)]



@dataclasses.dataclass(frozen=True)
class Replay:
    """A mismatch found at commit ``target`` (c), being replayed from commit ``back_to`` (a)."""

    target: int
    back_to: int
    verdict: ReplicaVerdict
    hosts: Tuple[str, ...]
    first: Optional[str]
    count: int  # replays in a row for this mismatch


class ReplicaCheck:
    """One rank's part in the replica check (see the module docstring).

    Args:
        every: check every this many commits (by commit id); 0 turns it off.
        tracked: the State's objects and adapters.
        buffers: the State's commit buffers (what is digested).
        events: the State's event log.
        exclude_file: where a host struck twice is added (None: nowhere).
    """

    def __init__(self, every: int, tracked: Tracked, buffers: CommitBuffers, events: EventLog,
                 exclude_file: Optional[str] = None) -> None:
        self.every = every
        self.tracked = tracked
        self.buffers = buffers
        self.events = events
        self.exclude_file = exclude_file
        self.offenders = RepeatOffenders()
        self.agreed = AgreedCommit()  # the commit a replay goes back to
        self.last_agreed: Optional[int] = None  # the newest commit id on which every rank agreed
        self.replay: Optional[Replay] = None
        # The checkpoint writer (rank 0, with a checkpoint directory): while a mismatch is unexplained,
        # retention keeps the checkpoint of the last agreed commit (later ones may hold a corrupt copy).
        self.checkpoints: Optional[Any] = None
        self._digested: Optional[Tuple[List[str], Dict[str, FrozenSet[str]]]] = None

    def due(self, commit_id: int) -> bool:
        """True at the commits that are checked: every ``every``-th, and the one a replay is heading
        for (the same on every rank: commit ids are agreed, and every rank replays together)."""
        if self.every <= 0 or commit_id <= 0:
            return False
        return commit_id % self.every == 0 or (self.replay is not None and commit_id == self.replay.target)

    def synced(self, commit_id: int) -> None:
        """After a sync every rank holds the same commit: it is the last agreed one (kept at the next
        commit, off the recovery's path), and a replay under way ends."""
        self.replay = None
        if self.every > 0:
            self.last_agreed = commit_id
            self.agreed.note_synced(commit_id)

    def before_commit(self, commit_id: int) -> None:
        """Before a commit changes the buffers (which hold commit ``commit_id``): keeps a synced commit."""
        if self.every > 0:
            self.agreed.keep_pending(self.buffers.entries, commit_id)

    def slots(self, rank: int, size: int, commit_id: int) -> Optional[np.ndarray]:
        """This rank's part of the commit's max-allreduce at a checked commit (its digest), else None."""
        self._digested = None
        if not self.due(commit_id) or self.buffers.entries is None:
            return None
        names = self.tracked.synced(self.buffers.entries)
        keys = {name: self.tracked.buffer_keys(name) for name in names}
        self._digested = (names, keys)
        return pack_digest(rank, size, replica_digest(self.buffers.entries, names, keys))

    # Its part in the commit (a CommitContribution): a checked commit's digest, acted on at once.
    blocking = True  # a replay must start before any rank trains on from a commit that differs

    def row(self, at: CommitPoint) -> Optional[np.ndarray]:
        return self.slots(at.rank, at.size, at.commit_id)

    def check(self, columns: np.ndarray, at: CommitPoint) -> None:
        self.act(columns, at.binding, at.commit_id, at.liveness, at.term_grace_s)

    def observe(self, columns: Optional[np.ndarray], at: CommitPoint) -> bool:
        return False  # acted on in check(): nothing more to read

    def enact(self, at: CommitPoint) -> bool:
        return False  # a host struck twice leaves through the leave path, asked in act()

    def act(self, reduced: np.ndarray, binding: Binding, commit_id: int, liveness: Any, term_grace_s: float) -> None:
        """Acts on the agreed table of digests (every rank together; collectives only when they differ).

        Raises:
            ReplicaMismatchError: ranks differ; every rank replays from the last agreed commit.
            StateDivergenceError: the same ranks differ again after a replay (a deterministic
                divergence), or no agreed commit is kept to replay from, or the mismatch kept moving.
        """
        verdict = judge(reduced)
        replay, self.replay = self.replay, None
        if verdict.agreed:
            self.last_agreed = commit_id
            self.agreed.keep(self.buffers.entries, commit_id)
            if replay is not None and replay.target == commit_id:
                self._transient(replay, binding, liveness, term_grace_s)
                if self.checkpoints is not None:
                    self.checkpoints.release()
            return
        names, keys = self._digested
        hosts = tuple(gather_hosts(binding))
        root = verdict.majority[0] if verdict.majority else min(set(range(len(hosts))) - set(verdict.wrong))
        first, _ = first_difference(binding, root, list(verdict.wrong), digest_items(self.buffers.entries, names, keys))
        fields = self._fields(commit_id, verdict, hosts, first)
        if replay is not None and replay.target == commit_id and replay.verdict.wrong == verdict.wrong:
            self.events.emit(REPLICA_MISMATCH, **fields, cause="divergence", healed=False,
                             replayed_from=replay.back_to, replays=replay.count, struck_hosts=[], repeat_hosts=[])
            raise StateDivergenceError(self._divergence(verdict, hosts, commit_id, first, replay.back_to))
        count = 1 if replay is None else replay.count + 1
        if self.agreed.entries is None or count > MAX_REPLAYS:
            self.events.emit(REPLICA_MISMATCH, **fields, cause="unexplained", healed=False,
                             replayed_from=None, replays=count - 1, struck_hosts=[], repeat_hosts=[])
            why = (f"it came back {MAX_REPLAYS} times in other ranks or commits" if self.agreed.entries is not None
                   else "no commit on which every rank agreed is kept to replay from")
            raise StateDivergenceError(
                f"replica check at commit {commit_id}: ranks committed different states that must agree "
                f"(first difference: {first}; {describe(verdict, hosts)}) and {why}: stopping rather than "
                f"training on a corrupt replica. The last commit on which every rank agreed is {self.last_agreed}")
        self.replay = Replay(commit_id, int(self.agreed.commit_id), verdict, hosts, first, count)
        if self.checkpoints is not None:
            self.checkpoints.hold(int(self.agreed.commit_id))
        self.events.emit(REPLICA_REPLAY, **fields, back_to=self.agreed.commit_id, replays=count)
        logger.warning("[rank %d] replica check at commit %d: ranks %s differ (first difference: %s); every rank "
                       "replays from commit %d", binding.rank(), commit_id, list(verdict.wrong), first,
                       self.agreed.commit_id)
        raise ReplicaMismatchError(commit_id, int(self.agreed.commit_id), list(verdict.wrong), first)

    def _fields(self, commit_id: int, verdict: ReplicaVerdict, hosts: Tuple[str, ...], first: Optional[str]) -> dict:
        return {"commit_id": commit_id, "wrong_ranks": list(verdict.wrong),
                "wrong_hosts": [hosts[r] for r in verdict.wrong], "majority_ranks": list(verdict.majority),
                "first_difference": first, "last_agreed_commit_id": self.last_agreed}

    def _transient(self, replay: Replay, binding: Binding, liveness: Any, term_grace_s: float) -> None:
        """Every rank agrees after the replay: a hardware fault. The hosts a strict majority named get a strike."""
        verdict, hosts = replay.verdict, replay.hosts
        struck = [hosts[r] for r in verdict.wrong] if verdict.majority else []  # a tie names nobody
        repeat = self.offenders.note(struck)
        rank = binding.rank()
        if struck and rank in verdict.wrong and hosts[rank] in repeat:
            exclude_host(self.exclude_file, hosts[rank], "committed a corrupt replica twice")
            liveness.ask_to_leave(term_grace_s, cause="replica")
        self.events.emit(REPLICA_MISMATCH, **self._fields(replay.target, verdict, hosts, replay.first),
                         cause="transient", healed=True, replayed_from=replay.back_to, replays=replay.count,
                         struck_hosts=list(dict.fromkeys(struck)), repeat_hosts=repeat)

    def _divergence(self, verdict: ReplicaVerdict, hosts: Tuple[str, ...], commit_id: int, first: Optional[str],
                    back_to: int) -> str:
        return (f"replica check at commit {commit_id}: ranks {list(verdict.wrong)} differ from the others in state "
                f"that must agree (first difference: {first}; {describe(verdict, hosts)}), and they differ again "
                f"after every rank went back to commit {back_to}, on which all agreed, and trained again to commit "
                f"{commit_id}: the divergence is deterministic, not a hardware fault, and no host was struck. "
                "Likely causes: an object whose restore or sync lost a link (a scheduler, EMA or cached param group "
                "that no longer writes where the optimizer reads), per-rank configuration in state that must agree "
                "(a learning rate, seed or flag that depends on the rank), rank-dependent code in the training step, "
                "or nondeterministic kernels (on a GPU: torch.use_deterministic_algorithms(True), "
                "TF_DETERMINISTIC_OPS=1). Mark an object that is legitimately per rank with State(..., per_rank=(name,))")

"""How a policy takes part in a commit: its slots in the commit's one collective, its action on the table.

The commit runs one max-allreduce (:mod:`elastic_ext.state.host_updates`):
the commit id, the hosts' news, and after them the *extra* columns that
policies add. A policy that acts at commit implements
:class:`CommitContribution`; the State is given its contributions in order
(:class:`CommitSlots`), and :func:`elastic_ext.state.decisions.decide_at_commit`
gathers their rows into the extra, runs the collective, and hands each one
its own columns of the reduced table. A new policy at commit is one class in
its own file under ``policies/``, added where the State is assembled
(:mod:`elastic_ext.runtime.assembly`); nothing here names a policy.

What each call may do (every rank calls them alike, in the order of the contributions):

1. :meth:`~CommitContribution.row`: this rank's slots, or None to add nothing
   at this commit (the width of a row must be the same on every rank);
2. :meth:`~CommitContribution.check`, with its columns of this commit's own
   table, before the hosts' news are reported: it may raise on every rank
   together (the replica check's replay);
3. :meth:`~CommitContribution.observe`, with its columns of each table agreed
   at this commit (where commits overlap, an earlier commit's table first):
   True when the world changes (a rank is evicted);
4. :meth:`~CommitContribution.enact`, once the tables are observed: it acts
   on what it decided (emits its events, asks this rank to leave) and returns
   True when the world changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from elastic_ext.binding import Binding
from elastic_ext.events import EventLog
from elastic_ext.liveness import Liveness


@dataclasses.dataclass(frozen=True)
class CommitPoint:
    """What a contribution may use at one commit (the same fields on every rank but ``rank``)."""

    binding: Binding
    rank: int
    size: int
    commit_id: int
    objects: Iterable[Any]  # the State's tracked objects
    liveness: Liveness
    term_grace_s: float
    events: EventLog


class CommitContribution(Protocol):
    """One policy's part in the commit's collective (see the module docstring)."""

    #: True when a commit that carries this contribution's row must reduce at once, even where
    #: commits overlap (its action cannot wait one commit).
    blocking: bool

    def row(self, at: CommitPoint) -> Optional[np.ndarray]:
        """This rank's int64 slots for the max-allreduce, or None to add nothing at this commit."""

    def check(self, columns: np.ndarray, at: CommitPoint) -> None:
        """Acts on its columns of this commit's own table, before the hosts' news (may raise)."""

    def observe(self, columns: Optional[np.ndarray], at: CommitPoint) -> bool:
        """Reads its columns of an agreed table (None: it had no row there); True: the world changes."""

    def enact(self, at: CommitPoint) -> bool:
        """Acts on what the tables decided, once per commit; True: the world changes."""


Layout = Tuple[Tuple[CommitContribution, int], ...]  # (contribution, width) per row, in column order


class CommitSlots:
    """The State's contributions, in column order, and the layout of the table still in flight."""

    def __init__(self, contributions: Sequence[CommitContribution] = ()) -> None:
        self.contributions: List[CommitContribution] = list(contributions)
        # Where commits overlap, a commit reads the previous commit's table: its layout. A blocking
        # commit never leaves its table in flight, so only a layout of non-blocking rows is kept.
        self.earlier: Layout = ()

    def rows(self, at: CommitPoint) -> Tuple[Optional[np.ndarray], Layout, bool]:
        """This commit's extra (None when no contribution adds a row), its layout, and whether it blocks."""
        rows, layout, blocking = [], [], False
        for contribution in self.contributions:
            row = contribution.row(at)
            if row is not None:
                rows.append(row)
                layout.append((contribution, len(row)))
                blocking = blocking or contribution.blocking
        extra = None if not rows else rows[0] if len(rows) == 1 else np.concatenate(rows)
        return extra, tuple(layout), blocking


def columns(table: Optional[np.ndarray], layout: Layout, contribution: CommitContribution) -> Optional[np.ndarray]:
    """``contribution``'s columns of ``table`` (laid out by ``layout``), or None where it had no row."""
    if table is None:
        return None
    start = 0
    for owner, width in layout:
        if owner is contribution:
            return table if width == len(table) else table[start:start + width]
        start += width
    return None

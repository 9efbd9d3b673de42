"""What a rank counts across commits and resets: its commit id and generation, rollbacks in a row.

Both are agreed by every rank at a sync (:mod:`elastic_ext.state.sync`
broadcasts them; the time of the last commit stays this rank's own); ``run``
counts rollbacks against ``rollback_limit``. The State's parts are given the
:class:`CommitRecord` itself, so they read the id as it stands when they act.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional


@dataclasses.dataclass
class CommitRecord:
    """Where this rank stands: its last commit id, whether it went through a sync, the generation,
    and when it last committed."""

    commit_id: int = 0
    participated: bool = False  # True once this process went through a sync
    generation: int = 0         # +1 per sync, agreed by all ranks
    commit_time: Optional[float] = None  # time.time() of this rank's last own commit (not agreed)


@dataclasses.dataclass
class RollbackRecord:
    """Consecutive rollbacks without a new commit, agreed by every rank (``sync`` broadcasts it).

    ``run`` counts each rollback with :meth:`note` and stops at
    ``config.rollback_limit`` (:class:`RollbackLimitError`).
    """

    in_a_row: int = 0     # rollbacks since the last new commit
    commit_id: int = -1   # the commit they all went back to

    def note(self, commit_id: int) -> int:
        """Counts a rollback to ``commit_id``; returns how many happened in a row without a new commit."""
        if commit_id == self.commit_id:
            self.in_a_row += 1
        else:
            self.in_a_row, self.commit_id = 1, commit_id
        return self.in_a_row

    def to_json(self) -> Dict[str, int]:
        return {"in_a_row": self.in_a_row, "commit_id": self.commit_id}

    def load_json(self, data: Dict[str, int]) -> None:
        self.in_a_row, self.commit_id = int(data["in_a_row"]), int(data["commit_id"])

"""Structured recovery events: one JSON object per line, plus a log line.

Events are what benchmarks and users read to learn what a job went through:
``sync`` (state brought in line across ranks), ``rollback`` (a collective
failed and the state went back to the last commit), ``resize`` (hosts were
added or removed, no rollback), ``reset`` (Horovod re-initialised after
either), ``commit`` (only with ``log_commits``), ``finish``, ``stall`` (this worker
declared itself stuck), ``suspended`` (the process did not run for
``gap_s`` seconds: the job was suspended; the stall clock restarted) and
``leave`` (a SIGTERMed worker, or every rank under MPI, leaves at a commit;
``durable_commit_id`` is the newest checkpoint rank 0 made durable first).
Every event carries ``event``, ``time`` (Unix seconds), ``rank`` and
``size`` as seen when it was written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class EventLog:
    """Appends events to a JSON-lines file (if a path is given) and logs them.

    Args:
        path: file to append to; ``{rank}`` is replaced by ``rank_fn()`` the
            first time an event is written. ``None`` only logs.
        rank_fn: returns this worker's current rank.
        size_fn: returns the current world size.
    """

    def __init__(self, path: Optional[str], rank_fn: Callable[[], int], size_fn: Callable[[], int]) -> None:
        self._path_template = path
        self._rank_fn = rank_fn
        self._size_fn = size_fn
        self._file = None
        self._lock = threading.Lock()
        self.history: list[dict] = []

    def _safe(self, fn: Callable[[], int]) -> int:
        # Rank and size are unavailable while Horovod is shut down during a reset.
        try:
            return int(fn())
        except Exception:  # noqa: BLE001 - an event must never fail because Horovod is down
            return -1

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "time": time.time(), "rank": self._safe(self._rank_fn),
                  "size": self._safe(self._size_fn), "pid": os.getpid()}
        record.update(fields)
        self.history.append(record)
        line = json.dumps(record, sort_keys=True, default=str)
        logger.info("[rank %s] %s", record["rank"], line)
        if self._path_template is not None:
            with self._lock:
                if self._file is None:
                    path = self._path_template.replace("{rank}", str(record["rank"]))
                    parent = os.path.dirname(path)
                    if parent:
                        os.makedirs(parent, exist_ok=True)
                    self._file = open(path, "a", encoding="utf-8")
                self._file.write(line + "\n")
                self._file.flush()
        return record


def read_events(path: str) -> list[dict]:
    """Reads a JSON-lines event file written by :class:`EventLog`.

    A missing file reads as no events: a worker that never emitted one
    never opened its file.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]

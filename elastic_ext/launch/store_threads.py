"""Threads of the driver's store for the requests that wait on the driver (:mod:`~.store_loop`), reused.

Such a request waits until the driver acts (a rank request until the
round forms, which takes every member's request), so the threads are not
bounded: a fixed pool could hold every thread on requests whose wait ends
only once those still queued are served. A thread that finished its job
takes the next; a new one starts only when none is idle, and one idle for
:data:`IDLE_S` ends.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger(__name__)

IDLE_S = 30.0  # a reused thread waits this long for another job, then ends


class ReusedThreads:
    """Threads that run one job after another; a new one only when none is idle.

    Invariant (under ``_lock``): ``_idle`` = threads waiting on the queue minus jobs queued, never
    negative: every queued job has a waiting thread that will take it.
    """

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            promised = self._idle > 0
            if promised:
                self._idle -= 1
                self._queue.put(job)
        if not promised:  # every thread is busy: a new one, with this job as its first
            threading.Thread(target=self._serve, args=(job,), name="elastic_ext-store", daemon=True).start()

    def _serve(self, job: Callable[[], None]) -> None:
        while True:
            try:
                job()
            except Exception:  # noqa: BLE001 - a job's own failure; the thread serves on
                logger.exception("elastic_ext: the driver's store failed serving a request")
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._queue.get(timeout=IDLE_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # more waiting threads than queued jobs: this one may end
                            self._idle -= 1
                            return
                    # every waiting thread was promised a job that is on its way: wait for it


__all__ = ["IDLE_S", "ReusedThreads"]

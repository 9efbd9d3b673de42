"""Restoring the last commit after a failed collective, beside Horovod's re-forming.

After a failed collective each survivor restores the last commit, re-forms
Horovod (shutdown, the rendezvous with the driver's next round, the Gloo
context), then syncs, which digests the commit to check that the survivors
agree. Copying a large state back and digesting it need no peer, while the
re-forming mostly waits on the driver and the network; both copies release
the GIL. So :class:`BackgroundRestore` restores the large entries (at least
:data:`LARGE_BYTES` of arrays) and digests the commit on a thread while the
main thread re-forms. Small entries (the step counter: ``run`` reads it at
once) are restored on the calling thread, as are samplers (``run`` adds
skipped ranges to them at once) and TensorFlow's objects, whose variables
are assigned on the thread that runs the model.

The State joins the thread (:meth:`BackgroundRestore.join`) before anything
that reads or writes its tracked objects or its commit: restore, commit,
sync, the reset callbacks; an error the thread met is raised there.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, FrozenSet, List, Optional

from elastic_ext.state.snapshot import Entry
from elastic_ext.state.digests import Digests

LARGE_BYTES = 1 << 20  # entries with fewer bytes of arrays are restored at once, on the calling thread


def is_large(entry: Entry) -> bool:
    """True if ``entry`` holds at least :data:`LARGE_BYTES` of arrays."""
    return sum(a.nbytes for a in entry.arrays.values()) >= LARGE_BYTES


def lower_priority() -> None:
    """Gives the calling thread the lowest CPU priority (Linux: a thread's own nice value), so that
    the re-forming's processes (this rank's main thread, the driver, the peers) run first on shared cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the same work at the same priority
        pass


class BackgroundRestore:
    """One restore's thread: applies ``later`` entries, then digests the synced ones (see the module docstring).

    Args:
        apply: brings one object to its entry (``Tracked.apply``).
        later: the entries to restore on the thread, by name.
        synced: the committed entries the next sync digests, by name, with their buffer keys.
        digests: where the digests go (the sync reads them from there).
    """

    def __init__(self, apply: Callable[[str, Entry], None], later: Dict[str, Entry],
                 synced: Dict[str, Entry], buffer_keys: Dict[str, FrozenSet[str]], digests: Digests) -> None:
        self._apply, self._later, self._synced, self._keys, self._digests = apply, later, synced, buffer_keys, digests
        self._error: Optional[BaseException] = None
        self.duration_s: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="elastic_ext-restore", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            lower_priority()
            for name, entry in self._later.items():
                self._apply(name, entry)
            for name, entry in self._synced.items():
                self._digests.items(name, entry, self._keys[name])
        except BaseException as exc:  # noqa: BLE001 - raised again by join() on the State's thread
            self._error = exc
        finally:
            self.duration_s = time.perf_counter() - started

    def join(self) -> None:
        """Waits for the thread; raises what it raised."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def split(entries: Dict[str, Entry], may_wait: Callable[[str], bool]) -> List[Dict[str, Entry]]:
    """``[now, later]``: the entries to restore on the calling thread and the large ones
    for the thread, of those whose objects ``may_wait`` says nothing reads before the join."""
    now: Dict[str, Entry] = {}
    later: Dict[str, Entry] = {}
    for name, entry in entries.items():
        (later if is_large(entry) and may_wait(name) else now)[name] = entry
    return [now, later]

"""When ``elastic-horovodrun``'s driver dismisses a worker that is still starting (change 4).

:func:`worth_dismissing` is the rule; :func:`dismiss_starting` applies it
after a member's failure and writes each dismissed worker's
:func:`~elastic_ext.control.store.dismissed_key`.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, List

from elastic_ext.control import store
from elastic_ext.launch.driver_state import state_of, store_write
from elastic_ext.control.store import dismissed_key

logger = logging.getLogger(__name__)


def worth_dismissing(elapsed_s: List[float], typical_s: float, going_on: int, regrow_wait_s: float = 0.0) -> bool:
    """True when the workers ``elapsed_s`` into starts that typically take ``typical_s`` are better started again.

    All or none: the round waits for the last of them. Waiting idles the
    ``going_on`` members until the least advanced start ends; not waiting
    leaves each slot without a worker for what its new one will take to get
    as far again: its own ``elapsed_s``, plus ``regrow_wait_s`` before the
    early start that starts it (module docstring, change 4).
    """
    if going_on <= 0 or not elapsed_s:
        return False
    return going_on * (typical_s - min(elapsed_s)) > sum(e + regrow_wait_s for e in elapsed_s)


def dismiss_starting(driver: Any) -> None:
    """After a member's failure: dismisses the round's workers still starting if it is worth it (change 4)."""
    from horovod.runner.elastic.registration import FAILURE

    ext = state_of(driver)
    if store.server_of(driver) is None:
        return
    registry = driver._worker_registry
    with registry._lock:
        recorded = set(registry._states)
        failures = len(registry._workers[FAILURE])
    announced = set(store.keys_local(driver, store.READY_SCOPE))
    now = time.monotonic()
    with ext.lock:
        if not (ext.starts or ext.other_starts):
            return
        typical = statistics.median(ext.starts or ext.other_starts)
        regrow_wait = statistics.median(ext.regrow_waits) if ext.regrow_waits else 0.0
        starting = {}
        for slot, started in ext.starting.items():
            if slot in recorded or slot in ext.dismissed or not driver.has_rank_assignment(*slot):
                continue
            if slot not in ext.newcomers:
                return  # the round waits for it anyway: it does not read a dismissal
            if str(driver.get_slot_info(*slot).rank) in announced:
                continue  # it built its model and is about to ask: it stopped reading its dismissal
            starting[slot] = now - started
        going_on = driver.world_size() - len(ext.dismissed) - len(starting) - failures - 1
        if going_on < driver._min_num_proc or not worth_dismissing(list(starting.values()), typical, going_on,
                                                                   regrow_wait):
            return  # also when none is starting: worth_dismissing is False for no worker
        dismissed = sorted(starting)
        ext.dismissed.update(dismissed)
    for host, local_rank in dismissed:
        store_write(driver, dismissed_key(host, local_rank), b"1")
    logger.warning("elastic_ext: a member of round %d failed; dismissing %s, still starting (%s s of a typical "
                   "%.1f s start): the %d members going on start now, and the slots come back while they train",
                   registry.last_rendezvous(), ", ".join(f"{h}[{r}]" for h, r in dismissed),
                   ", ".join(f"{starting[slot]:.1f}" for slot in dismissed), typical, going_on)

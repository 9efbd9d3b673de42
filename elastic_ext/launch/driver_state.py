"""What ``elastic-horovodrun``'s driver keeps beside Horovod's own fields, and its store writes.

The per-driver record (:class:`DriverState`, found with :func:`state_of`),
the keys the driver writes for its workers, and the pure rules on a round's
slots (:func:`survivors_by_host`, :func:`moves`) that the changes of
:mod:`elastic_ext.launch.driver` share.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from elastic_ext.control import store
from elastic_ext.control.store import ROUND_SCOPE as SCOPE

STARTS_KEPT = 16     # the workers' latest starts (start to first rank request) the typical start is taken from

Slot = Tuple[str, int]


def store_write(driver: Any, key: str, value: bytes) -> None:
    """Writes into the driver's rendezvous server's key-value store (the scope workers read; only here)."""
    store.write_local(driver, SCOPE, key, value)


def early_start_asked(driver: Any) -> bool:
    """True when an early start's rank requests complete this round (they are in the store until it forms)."""
    return store.keys_local(driver, store.READY_SCOPE).get(store.ASKED) is not None


def state_of(driver: Any) -> "DriverState":
    """The driver's :class:`DriverState`, made at its first use."""
    return driver.__dict__.setdefault("elastic_ext", DriverState())


@dataclasses.dataclass
class DriverState:
    """What the changed driver keeps beside Horovod's own fields."""

    # Which process holds each slot now: the SlotInfo Horovod started it with, compared by identity.
    holders: Dict[Slot, Any] = dataclasses.field(default_factory=dict)
    # For the round being answered: a survivor's old local rank -> its new one, by host.
    moved: Dict[Slot, int] = dataclasses.field(default_factory=dict)
    # Set by a round's barrier: the slots of the workers that asked, by host (old local ranks, sorted).
    survivors: Optional[Dict[str, List[int]]] = None
    # While building a survivors' round: the slot count per host that _get_host_assignments uses.
    only: Optional[Dict[str, int]] = None
    # Hosts with a worker that ended itself because its round's peers failed, until the round is recorded.
    peers_failed: Set[str] = dataclasses.field(default_factory=set)
    regrow: bool = False                 # the current round left capacity out: tell the coordinator
    regrow_thread: Optional[threading.Thread] = None
    # Workers started and not yet asked for a rank: when each started (time.monotonic()), by slot.
    starting: Dict[Slot, float] = dataclasses.field(default_factory=dict)
    # Those of them an early start's round started: they read their dismissal while they start.
    newcomers: Set[Slot] = dataclasses.field(default_factory=set)
    early_round: bool = False            # the round being formed was completed by an early start's requests
    # The latest newcomers' starts, start to first rank request (s); other workers' until a newcomer's.
    starts: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    other_starts: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    # The latest waits from a round that left capacity out to the early start that took it back (s).
    regrow_waits: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    regrow_since: Optional[float] = None  # when the current round left capacity out
    # Starting workers dismissed in the current round (until it is recorded).
    dismissed: Set[Slot] = dataclasses.field(default_factory=set)
    # The slots ("host:local_rank") of the current round and the one before it, by round: a member's
    # failure is published for each of them it belongs to (the driver watch reads its own round only).
    rounds: Dict[int, Set[str]] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def survivors_by_host(ready: Any) -> Dict[str, List[int]]:
    """The READY slots of a round as {host: sorted local ranks}."""
    by_host: Dict[str, List[int]] = {}
    for host, local_rank in ready:
        by_host.setdefault(host, []).append(local_rank)
    return {host: sorted(ranks) for host, ranks in by_host.items()}


def moves(survivors: Dict[str, List[int]]) -> Dict[Slot, int]:
    """Each survivor's new local rank: a host's survivors take its local ranks 0, 1, ... in their order."""
    return {(host, old): new for host, ranks in survivors.items() for new, old in enumerate(ranks) if old != new}


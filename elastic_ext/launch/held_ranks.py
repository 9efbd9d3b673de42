"""Rank requests held on the store's loop: a round's parties counted without a thread each.

Horovod's ``WorkerStateRegistry`` makes every worker's rank request a party
of a ``threading.Barrier`` and holds the request's thread there until the
round forms. At 1,024 workers that was a thousand store threads started
while the requests arrived, and, when the barrier released them, a
thousand threads answering one after the other (each taking the barrier's
lock and the interpreter in turn): about half a second of a reset
(``bench/README.md``, "The control plane at scale").

Here the registry's barrier is a :class:`HeldBarrier`, a
``threading.Barrier`` whose parties may also be held requests: the store's
loop counts a rank request with :func:`record_ready_held` and returns; when
the round forms one thread answers every held request. Everything else is
Horovod's: the registry's states and lock, its ``_action`` (the round's
forming) and its rule on a ``reset()`` of the barrier (a party whose worker
is still READY counts again, one whose state changed is refused, as
Horovod's ``_wait`` raises ``RuntimeError`` there). A request that cannot be
counted so (while the round's action runs, while the barrier drains or
resets, a worker asking twice) takes Horovod's own path on a thread.

:class:`HeldBarrier` uses ``threading.Barrier``'s internal state
(``_cond``, ``_state``, ``_count``, ``_release``, ``_exit``), the same in
Python 3.11 and 3.12 (``tests/unit/test_held_ranks.py`` holds it to
``threading.Barrier``'s behaviour with threads and held parties together).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Tuple

from elastic_ext.control import store
from elastic_ext.launch.driver_slots import note_ready

logger = logging.getLogger(__name__)

READY = "READY"  # horovod.runner.elastic.registration.READY
HELD_SCOPES = frozenset({store.RANK_SCOPE})
HOLD_S = 7 * 24 * 3600.0  # as Horovod's thread, a rank request waits for its round without a bound
Done = Callable[[], None]
Failed = Callable[[str], None]


class HeldBarrier(threading.Barrier):
    """A ``threading.Barrier`` whose parties may also arrive without a thread (:meth:`arrive`)."""

    def __init__(self, parties: int, action: Optional[Callable[[], None]] = None,
                 on_reset: Optional[Callable[[Any, Done, Failed], None]] = None) -> None:
        super().__init__(parties, action)
        self._cond = threading.Condition(threading.RLock())  # reset() holds it around threading.Barrier's
        self._held: List[Tuple[Any, Done, Failed]] = []
        self._on_reset = on_reset  # how a held party is counted again after a reset()

    def arrive(self, key: Any, done: Done, failed: Failed) -> bool:
        """Counts a party that waits without a thread: ``done()`` when the barrier releases (on a thread of
        its own), ``failed(why)`` if its action fails. False (nothing counted) while the barrier drains or
        resets: the caller waits as a thread would."""
        with self._cond:  # type: ignore[attr-defined]
            if self._state != 0:  # type: ignore[attr-defined]
                return False
            self._count += 1  # type: ignore[attr-defined]
            self._held.append((key, done, failed))
            last = self._count == self._parties  # type: ignore[attr-defined]
        if last:  # the round's action may wait (for hosts): never on the store's loop
            threading.Thread(target=self._release_held, name="elastic_ext-round", daemon=True).start()
        return True

    def _release_held(self) -> None:
        with self._cond:  # type: ignore[attr-defined]
            try:
                self._release()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - the parties were told (_release); a thread's wait() would raise it
                logger.exception("elastic_ext: the round's action failed; the barrier is broken")
            finally:
                self._exit()  # type: ignore[attr-defined]

    def _release(self) -> None:
        # Under the lock, by the last party: a thread in wait() or _release_held. The held parties leave now.
        held, self._held = self._held, []
        self._count -= len(held)  # type: ignore[attr-defined]
        try:
            super()._release()  # type: ignore[misc]
        except BaseException:
            _answer(held, lambda d, f: f("the round could not form (the driver's action failed)"))
            raise
        _answer(held, lambda d, f: d())

    def reset(self) -> None:
        with self._cond:  # type: ignore[attr-defined]
            held, self._held = self._held, []
            self._count -= len(held)  # type: ignore[attr-defined]
            super().reset()
        # As a thread woken by the reset: on a thread of its own, since Horovod resets the barrier holding
        # the registry's lock, before it records the state that caused the reset.
        on_reset = self._on_reset or (lambda key, done, failed: failed("the round's barrier was reset"))
        if held:
            threading.Thread(target=lambda: [on_reset(*party) for party in held], name="elastic_ext-round-reset",
                             daemon=True).start()


def _answer(held: List[Tuple[Any, Done, Failed]], call: Callable[[Done, Failed], None]) -> None:
    """Tells every held party, on one thread; one that fails to be told costs only its own answer."""
    def tell() -> None:
        for _, done, failed in held:
            try:
                call(done, failed)
            except Exception:  # noqa: BLE001 - the others are still answered
                logger.exception("elastic_ext: a held rank request could not be answered")

    if held:
        threading.Thread(target=tell, name="elastic_ext-round-answers", daemon=True).start()


def held_reset(self: Any, size: int) -> None:
    """``WorkerStateRegistry.reset`` with a :class:`HeldBarrier` (Horovod's otherwise, line for line)."""
    with self._lock:
        logger.info("reset workers: %s", size)
        self._states.clear()
        self._workers.clear()
        self._barrier = HeldBarrier(size, self._action, lambda key, done, failed: _count(self, key, done, failed))
        self._rendezvous_id += 1
        self._size = size


def record_ready_held(driver: Any, host: str, local_rank: int, done: Done, failed: Failed) -> None:
    """The driver's ``record_ready`` for a rank request the store holds: ``done()`` once the round forms
    (at once where Horovod's would return at once), ``failed(why)`` where Horovod's would raise."""
    note_ready(driver, host, local_rank)
    registry = driver._worker_registry
    if driver.finished() or registry._host_manager.is_blacklisted(host):
        done()  # Horovod ignores the registration and answers
        return
    key = (host, local_rank)
    if not registry._action_event.is_set():  # the round's action runs: Horovod's path waits for it
        _on_thread(lambda: registry.record_ready(host, local_rank), done, failed)
        return
    with registry._lock:
        if key in registry._states:  # asked twice: Horovod logs it and waits at the barrier again
            logger.error("key exists and new state %s not FAILURE, ignoring (current state is %s)", READY,
                         registry._states[key])
        else:
            registry._states[key] = READY
            registry._workers[READY].add(key)
    _count(registry, key, done, failed)


def _count(registry: Any, key: Any, done: Done, failed: Failed) -> None:
    """Counts ``key``'s party in the registry's current barrier, or waits on a thread as Horovod's ``_wait``."""
    with registry._lock:
        state = registry._states.get(key, READY)
        barrier, rendezvous_id = registry._barrier, registry._rendezvous_id
    if state != READY:
        failed(f"State {READY} overridden by {state}")
        return
    if not (isinstance(barrier, HeldBarrier) and barrier.arrive(key, done, failed)):
        _on_thread(lambda: registry._wait(key, READY, rendezvous_id), done, failed)


def _on_thread(wait: Callable[[], Any], done: Done, failed: Failed) -> None:
    def run() -> None:
        try:
            wait()
        except Exception as exc:  # noqa: BLE001 - Horovod's thread would raise it into the handler
            failed(f"{type(exc).__name__}: {exc}")
            return
        done()

    threading.Thread(target=run, name="elastic_ext-rank", daemon=True).start()


def serve(handler: Any, key: str) -> None:
    """A rank request (``GET rank_and_size/<host>:<local rank>``) on the store's loop: held, counted in the
    round's barrier, answered with Horovod's slot string once the round forms."""
    host, _, local_rank = key.rpartition(":")
    reply = handler.request.defer(HOLD_S, lambda: (404, b""))

    def failed(why: str) -> None:
        reply(500, why.encode("utf-8", "replace")[:300])

    driver = driver_of(handler)
    if driver is None or not local_rank.isdigit():  # not Horovod's elastic handler, or a malformed key
        def ask() -> None:
            value = handler._get_value(store.RANK_SCOPE, key)
            reply(200, value) if value is not None else reply(404, b"")
        _on_thread(ask, lambda: None, failed)
        return
    slot = int(local_rank)
    record_ready_held(driver, host, slot,
                      lambda: reply(200, driver.get_slot_info(host, slot).to_response_string().encode("ascii")),
                      failed)


def driver_of(handler: Any) -> Any:
    """The ``ElasticDriver`` that the rendezvous handler class of Horovod's ``create_rendezvous_handler``
    closes over (its ``_get_rank_and_size`` reads the free variable ``driver``); None for another handler."""
    for cls in type(handler).__mro__:
        method = cls.__dict__.get("_get_rank_and_size")
        if method is not None and method.__closure__:
            cells = dict(zip(method.__code__.co_freevars, method.__closure__))
            if "driver" in cells:
                return cells["driver"].cell_contents
    return None


__all__ = ["HELD_SCOPES", "HOLD_S", "HeldBarrier", "driver_of", "held_reset", "record_ready_held", "serve"]

"""The registry's barrier with held rank requests (elastic_ext.launch.held_ranks): threading.Barrier's
behaviour for the parties that wait on a thread, the same for those the store holds without one."""

import threading

import pytest

from elastic_ext.launch.held_ranks import HeldBarrier


class Held:
    """A held party: what it was told, and when."""

    def __init__(self):
        self.done, self.failed, self.event = 0, [], threading.Event()

    def on_done(self):
        self.done += 1
        self.event.set()

    def on_failed(self, why):
        self.failed.append(why)
        self.event.set()


def waiting_threads(barrier, n):
    outcomes, threads = [], []

    def wait():
        try:
            barrier.wait()
            outcomes.append("passed")
        except threading.BrokenBarrierError:
            outcomes.append("broken")

    for _ in range(n):
        threads.append(threading.Thread(target=wait))
        threads[-1].start()
    return outcomes, threads


def wait_until(condition, what):
    deadline = threading.Event()
    for _ in range(1000):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("last", ["thread", "held"])
def test_threads_and_held_parties_pass_together_and_the_action_runs_once_off_the_arriving_thread(last):
    actions = []
    barrier = HeldBarrier(4, lambda: actions.append(threading.current_thread().name))
    held = [Held(), Held()]
    outcomes, threads = waiting_threads(barrier, 1)
    wait_until(lambda: barrier.n_waiting == 1, "the first thread at the barrier")
    assert barrier.arrive("a", held[0].on_done, held[0].on_failed)
    if last == "thread":
        assert barrier.arrive("b", held[1].on_done, held[1].on_failed)
        more, extra = waiting_threads(barrier, 1)
        threads += extra
    else:
        more, extra = waiting_threads(barrier, 1)
        threads += extra
        wait_until(lambda: barrier.n_waiting == 3, "the second thread at the barrier (held parties count)")
        assert barrier.arrive("b", held[1].on_done, held[1].on_failed)
    for thread in threads:
        thread.join(10)
    assert all(h.event.wait(10) for h in held)
    assert outcomes + more == ["passed", "passed"] and [h.done for h in held] == [1, 1]
    assert len(actions) == 1
    if last == "held":  # the store's loop never runs the round's action (it may wait for hosts)
        assert actions[0] == "elastic_ext-round", actions
    # The barrier is ready for the next round, as threading.Barrier is after its parties passed.
    wait_until(lambda: barrier.n_waiting == 0 and barrier._state == 0, "the barrier to refill")
    again = [Held() for _ in range(4)]
    for i, h in enumerate(again):
        assert barrier.arrive(i, h.on_done, h.on_failed)
    assert all(h.event.wait(10) for h in again) and [h.done for h in again] == [1, 1, 1, 1]
    assert len(actions) == 2


def test_a_reset_breaks_the_threads_and_counts_the_held_parties_again_through_the_registrys_rule():
    # Horovod resets the barrier holding the registry's lock, and records the new state after it: the held
    # parties are counted again (under that lock) on another thread, as the woken threads are.
    registry_lock, counted_again = threading.Lock(), []

    def count_again(key, done, failed):
        with registry_lock:
            counted_again.append(key)

    barrier = HeldBarrier(3, None, count_again)
    held = Held()
    assert barrier.arrive("held", held.on_done, held.on_failed)
    outcomes, threads = waiting_threads(barrier, 1)
    wait_until(lambda: barrier.n_waiting == 2, "the thread at the barrier (the held party counts)")
    with registry_lock:
        barrier.reset()
    threads[0].join(10)
    wait_until(lambda: counted_again == ["held"], "the held party counted again")
    assert outcomes == ["broken"] and not held.event.is_set()
    # No party is left counted: three new ones pass.
    fresh = [Held() for _ in range(3)]
    wait_until(lambda: barrier._state == 0, "the reset to end")
    for i, h in enumerate(fresh):
        assert barrier.arrive(i, h.on_done, h.on_failed)
    assert all(h.event.wait(10) for h in fresh) and [h.done for h in fresh] == [1, 1, 1]


def test_an_action_that_fails_fails_the_held_parties_and_breaks_the_threads():
    def action():
        raise RuntimeError("no hosts")

    barrier = HeldBarrier(3, action)
    held = [Held(), Held()]
    outcomes, threads = waiting_threads(barrier, 1)
    wait_until(lambda: barrier.n_waiting == 1, "the thread at the barrier")
    assert barrier.arrive("a", held[0].on_done, held[0].on_failed)
    assert barrier.arrive("b", held[1].on_done, held[1].on_failed)
    threads[0].join(10)
    assert all(h.event.wait(10) for h in held)
    assert outcomes == ["broken"] and barrier.broken
    assert [h.done for h in held] == [0, 0] and all(h.failed for h in held)


def test_a_held_party_is_not_counted_while_the_barrier_resets():
    barrier = HeldBarrier(3)
    outcomes, threads = waiting_threads(barrier, 2)
    wait_until(lambda: barrier.n_waiting == 2, "the threads at the barrier")
    with barrier._cond:  # as reset() leaves it while its threads have not woken yet: resetting
        barrier._state = -1
    held = Held()
    assert not barrier.arrive("late", held.on_done, held.on_failed)
    assert barrier._count == 2
    with barrier._cond:
        barrier._cond.notify_all()
    for thread in threads:
        thread.join(10)
    assert outcomes == ["broken", "broken"]


def test_a_party_whose_answer_fails_costs_only_its_own_answer():
    barrier = HeldBarrier(3)
    held = [Held(), Held()]

    def broken():
        raise RuntimeError("its connection is gone")

    assert barrier.arrive("a", held[0].on_done, held[0].on_failed)
    assert barrier.arrive("gone", broken, held[1].on_failed)
    assert barrier.arrive("b", held[1].on_done, held[1].on_failed)
    assert all(h.event.wait(10) for h in held) and [h.done for h in held] == [1, 1]

"""elastic_ext.worker.torch_wait: the wait that sleeps between polls (in a real job: test_collective_wait.py)."""

import pytest

from elastic_ext.worker import horovod_changes, torch_wait


class Handle:
    """Done after ``polls_left`` polls; its wait_and_clear releases it or raises its error."""

    def __init__(self, polls_left, error=None):
        self.polls_left, self.error = polls_left, error
        self.polls, self.cleared, self.pauses = 0, [], []

    def poll(self, handle):
        self.polls += 1
        self.polls_left -= 1
        return int(self.polls_left < 0)

    def wait_and_clear(self, handle):
        self.cleared.append(handle)
        if self.error:
            raise self.error


def test_a_done_collective_costs_one_poll_and_no_sleep():
    h = Handle(0)
    torch_wait.waiting(h.poll, h.wait_and_clear, h.pauses.append)(7)
    assert (h.polls, h.pauses, h.cleared) == (1, [], [7])


def test_the_pauses_double_up_to_the_cap_and_the_handle_is_cleared_once():
    h = Handle(12)
    torch_wait.waiting(h.poll, h.wait_and_clear, h.pauses.append)(3)
    assert h.polls == 13 and h.cleared == [3]
    assert h.pauses[0] == torch_wait.FIRST_PAUSE_S
    assert all(b == min(2 * a, torch_wait.MAX_PAUSE_S) for a, b in zip(h.pauses, h.pauses[1:])), h.pauses
    assert h.pauses[-1] == torch_wait.MAX_PAUSE_S


def test_the_collectives_error_comes_from_horovods_own_wait():
    h = Handle(2, RuntimeError("Horovod has been shut down"))
    with pytest.raises(RuntimeError, match="shut down"):
        torch_wait.waiting(h.poll, h.wait_and_clear, h.pauses.append)(5)
    assert h.cleared == [5]


def test_nothing_is_patched_before_the_extension_is_loaded(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, torch_wait.EXTENSION, raising=False)
    assert horovod_changes.replace_torch_wait() is False

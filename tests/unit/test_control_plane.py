"""The control plane's simulation (``bench.control_plane``) at a small N: the protocol's behaviour, not its speed.

The real driver and store of ``elastic-horovodrun`` in a process of their
own, simulated workers speaking the workers' HTTP protocol in this one
(``bench.control_plane_sim``): steady training, the driver stopped for 5 s
(SIGSTOP) under that load, one worker SIGKILLed, the survivors' reset with
Horovod's rank request and Gloo's rendezvous through the store.

N is 16 (two simulated hosts of 8), not 64: a reset's Gloo rendezvous is
about ``2.5 N^2`` store requests per global context (two per reset), some
20,000 in all at 64, which the driver's Python store serves at a few hundred
a second on this 2-core machine while the suite runs (minutes, and the
job start needs as many again); at 16 about 1,900. The job's start skips
Gloo's rendezvous (``--gloo-start-max 0``): the reset is what is asserted.

Timing-sensitive (a 5 s stall against the driver watch's fence after 10 s,
2 s request timeouts): exclusive, so it runs alone among the jobs.
"""

import pytest

from bench import control_plane

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(280)]

N = 16


@pytest.fixture(scope="module")
def run():
    args = control_plane.parse_args(["--workers", str(N), "--steady-s", "2", "--stall-s", "5", "--until", "reset",
                                     "--gloo-start-max", "0", "--start-timeout-s", "60",
                                     "--reset-timeout-s", "120", "--run-timeout-s", "250"])
    return control_plane.run_one(N, args)


def test_every_phase_ends_within_its_bound(run):
    assert run["timeouts"] == {}, run.get("stuck")


def test_every_survivor_is_released_into_the_new_round(run):
    assert run["survivors"] == N - 1
    assert run["survivors_released"] == N - 1
    assert run["survivor_answers"] == [N - 1]  # every survivor's rank request answered the round of N - 1


def test_the_failed_member_is_absent_from_the_new_round(run):
    # One slot per survivor, each survivor holding one rank of it: no place for the failed member.
    assert run["survivor_ranks_distinct"] is True
    assert run["round_slots"] == [N - 1]


def test_the_stall_happened_and_no_healthy_worker_would_have_fenced(run):
    assert run["phases"]["stalled"]["watch_failed_polls"] > 0  # the driver did not answer during the stall
    assert run["false_fences_stalled"] == 0
    assert run["false_fences"] == 0

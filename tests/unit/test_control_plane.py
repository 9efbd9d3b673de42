"""The control plane's simulation (``bench.control_plane``) at a small N: the protocol's behaviour, not its speed.

The real driver and store of ``elastic-horovodrun`` in a process of their
own, simulated workers speaking the workers' HTTP protocol in this one
(``bench.control_plane_sim``): steady training, the driver stopped (SIGSTOP)
for longer than a request's timeout under that load, one worker SIGKILLed,
the survivors' reset with Horovod's rank request and Gloo's rendezvous
through the store.

N is 8 on two simulated hosts of 4, the workers of this checkout: a reset's
Gloo rendezvous is one request per rank and context (Horovod with build
patch 08, ``elastic_ext.launch.gloo_exchange``), each held by the store until
the context's last rank has published; the job's start skips Gloo's
rendezvous (``--gloo-start-max 0``): the reset is what is asserted. The
stall is 5 s: every simulated worker polls at least once in its first 3 s
(a poll each second, the driver watch's 2 s wait for an answer), so that
poll connects and gets no answer within the stall even when this process
is itself kept off the CPU for a second or two by a loaded machine (with a
3 s stall one run saw every poll answered at the stall's end). None of
those polls counts toward the fence (it counts only handshakes not
completed, ``elastic_ext.runtime.driver_watch``), whatever the machine's
load; so this test needs no exclusive slot among the jobs.
"""

import pytest

from bench import control_plane
from elastic_ext.runtime import driver_watch

pytestmark = pytest.mark.timeout(200)

N = 8


@pytest.fixture(scope="module")
def run():
    args = control_plane.parse_args(["--workers", str(N), "--slots", "4", "--steady-s", "1", "--stall-s", "5",
                                     "--after-stall-s", "2", "--until", "reset", "--gloo-start-max", "0",
                                     "--start-timeout-s", "60", "--reset-timeout-s", "90", "--run-timeout-s", "180"])
    return control_plane.run_one(N, args)


def test_every_phase_ends_within_its_bound(run):
    assert run["timeouts"] == {}, run.get("stuck")
    assert run["driver_elastic_ext"].startswith(control_plane.HERE.rsplit("/", 1)[0]), run["driver_elastic_ext"]


def test_every_survivor_is_released_into_the_new_round(run):
    assert run["survivors"] == N - 1
    assert run["survivors_released"] == N - 1
    assert run["survivor_answers"] == [N - 1]  # every survivor's rank request answered the round of N - 1


def test_the_failed_member_is_absent_from_the_new_round(run):
    # One slot per survivor, each survivor holding one rank of it: no place for the failed member.
    assert run["survivor_ranks_distinct"] is True
    assert run["round_slots"] == [N - 1]


def test_a_stalled_driver_is_slow_not_lost_and_fences_nobody(run):
    stalled = run["phases"]["stalled"]
    assert stalled["watch_unanswered_polls"] > 0, stalled  # the driver did not answer during the stall ...
    assert stalled["watch_failed_polls"] == 0, stalled     # ... and no poll counted toward the fence
    assert run["false_fences_stalled"] == 0
    assert run["false_fences"] == 0
    assert driver_watch.POLL_S + driver_watch.REQUEST_TIMEOUT_S < 5  # a poll starts and times out in the stall

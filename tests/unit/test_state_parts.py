"""The State's parts, each built alone with small fakes (no State): the listener, the durable hand-off, the restorer;
and how the State shows a part's method as its own.

Each part gets only its constructor's arguments (:mod:`elastic_ext.state.parts`); the tests
of the whole State (test_state*.py, test_background_restore.py) cover how CoreState wires them.
"""

import inspect
import threading

import numpy as np
import pytest

from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.errors import CheckpointError, NotCommittedError
from elastic_ext.events import EventLog
from elastic_ext.liveness import Liveness
from elastic_ext.state.agreed import AgreedCommit
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.commit_slots import CommitSlots
from elastic_ext.state.digests import Digests
from elastic_ext.state.durable import DurableCommits
from elastic_ext.state.host_updates import HOSTS_ADDED, HostUpdates
from elastic_ext.state.listener import HorovodListener
from elastic_ext.state.parts import Delegated
from elastic_ext.state.records import CommitRecord
from elastic_ext.state.restore import LARGE_BYTES
from elastic_ext.state.restoring import Restorer
from elastic_ext.state.tracked import Tracked
from elastic_ext.testing import SoloBinding, state_on

LARGE = LARGE_BYTES // 4 * 2  # float32 elements: an entry large enough for the background restore


class WorldWatcher(ElasticPartitioner):
    """A sampler that notes when it is told the world changed."""

    def __init__(self, calls):
        super().__init__(64, global_batch_size=8, world=lambda: (0, 1))
        self.calls = calls

    def on_world_change(self):
        self.calls.append("world changed")


def committed(objects):
    """The objects tracked, and commit buffers holding one commit of them."""
    tracked = Tracked(objects, (), ())
    buffers = CommitBuffers(1)
    buffers.copy(tracked.capture())
    return tracked, buffers


# ------------------------------------------------------------------ listener

def listener(tracked, buffers, record, calls, failing=None, hosts=None, live=None):
    live = live or [Liveness()]
    return HorovodListener(
        hosts=hosts or HostUpdates(), tracked=tracked, buffers=buffers, record=record, slots=CommitSlots(),
        binding=SoloBinding, liveness=lambda: live[0], events=EventLog(None, lambda: 0, lambda: 1),
        term_grace_s=5.0, settle_restore=lambda: calls.append("restore settled"),
        reset_policies=lambda: calls.append("policies reset"), checkpoints_failing=lambda: failing)


def test_the_listener_settles_the_restore_then_runs_the_reset_callbacks_in_order_into_the_commit():
    calls = []
    tracked, buffers = committed({"lr": np.array([0.1]), "sampler": WorldWatcher(calls)})
    record, hosts = CommitRecord(commit_id=4), HostUpdates()
    part = listener(tracked, buffers, record, calls, hosts=hosts)
    hosts.put(17, HOSTS_ADDED)
    assert part.host_update_pending()

    def scale_lr(factor):
        def callback():
            calls.append(f"x{factor}")
            tracked.objects["lr"] *= factor
        return callback

    part.register_reset_callbacks([scale_lr(2)])
    part.register_reset_callbacks([scale_lr(3)])
    part.on_reset()
    assert calls == ["restore settled", "policies reset", "world changed", "x2", "x3"]
    assert not part.host_update_pending()  # a reset acts on the news it had
    # What the callbacks changed is what the next sync ships: the commit took it, under the same id.
    tracked.objects["lr"][:] = 0.0
    tracked.apply("lr", buffers.entries["lr"])
    assert tracked.objects["lr"].tolist() == pytest.approx([0.6]) and record.commit_id == 4


def test_the_listener_stops_every_rank_at_the_commit_it_reads_when_checkpoints_keep_failing():
    calls = []
    tracked, buffers = committed({"step": 0})
    record = CommitRecord()
    part = listener(tracked, buffers, record, calls, failing="disk full")
    record.commit_id = 7  # the part reads the id as it stands when it acts
    with pytest.raises(CheckpointError, match=r"stopping at commit 7: .*\(disk full\)"):
        part.check_host_updates()
    ok = listener(tracked, buffers, record, calls, failing=None)
    ok.check_host_updates()  # nothing failing, no host news: the commit goes on


def test_the_listener_reads_the_liveness_it_is_given_when_the_commit_decides():
    from horovod.common.exceptions import HostsUpdatedInterrupt
    tracked, buffers = committed({"step": 0})
    live = [Liveness()]
    part = listener(tracked, buffers, CommitRecord(), [], live=live)
    part.check_host_updates()  # nobody leaves
    live[0] = Liveness()  # the State's liveness replaced (a rank simulated by a thread has its own)
    live[0].ask_to_leave(60.0)
    with pytest.raises(HostsUpdatedInterrupt):
        part.check_host_updates()  # the leave acts at this commit, on every rank


# ------------------------------------------------------------------- durable

class FakeWriter:
    """A checkpoint writer that notes what it was handed."""

    def __init__(self, due=True, failing=None):
        self.is_due, self.failure, self.handed, self.waited = due, failing, [], []
        self.last_written = None
        self.observed = self.failures = 0

    def wait(self, timeout_s=None):
        self.waited.append(timeout_s)
        return True

    def observe_commit(self):
        self.observed += 1

    def due(self, commit_id):
        return self.is_due

    def on_commit(self, commit_id, names, info, force=False):
        self.handed.append((commit_id, list(names), info, force))
        self.last_written = commit_id

    def note_failure(self):
        self.failures += 1

    def failing(self):
        return self.failure


class RankOne(SoloBinding):
    def rank(self):
        return 1


class ShutDown(SoloBinding):
    def rank(self):
        raise ValueError("Horovod has not been initialized")


def durable(writer, binding=None, record=None):
    tracked, buffers = committed({"weights": np.arange(3.0), "step": 2})
    return DurableCommits(writer=writer, buffers=buffers, tracked=tracked, record=record or CommitRecord(),
                          binding=lambda: binding or SoloBinding())


def test_the_durable_part_reports_a_failing_writer_on_rank_0_only():
    assert durable(FakeWriter(failing="EIO on /ckpt")).checkpoints_failing() == "EIO on /ckpt"
    assert durable(FakeWriter(failing="EIO on /ckpt"), RankOne()).checkpoints_failing() is None
    assert durable(FakeWriter(failing="EIO on /ckpt"), ShutDown()).checkpoints_failing() is None
    assert durable(None).checkpoints_failing() is None  # no checkpoint_dir


def test_the_durable_part_hands_a_due_commit_with_the_record_as_it_stands():
    writer, record = FakeWriter(), CommitRecord()
    part = durable(writer, record=record)
    record.commit_id, record.generation, record.commit_time = 5, 2, 1234.5
    part.checkpoint_commit()
    [(commit_id, names, info, force)] = writer.handed
    assert (commit_id, sorted(names), force) == (5, ["step", "weights"], False)
    assert (info["generation"], info["commit_time"], info["world_size"]) == (2, 1234.5, 1)
    assert part.wait_for_checkpoint(3.0) == 5 and writer.waited == [3.0]
    writer.is_due = False
    part.checkpoint_commit()  # not due: measured, not handed
    assert len(writer.handed) == 1 and writer.observed == 2
    part.checkpoint_now()  # a leave: written even though not due
    assert [h[3] for h in writer.handed] == [False, True]
    part.note_failure()
    assert writer.failures == 1


def test_the_durable_part_writes_nothing_off_rank_0_or_without_a_writer():
    writer = FakeWriter()
    durable(writer, RankOne()).checkpoint_now()
    durable(writer, ShutDown()).checkpoint_now()
    assert writer.handed == []
    assert durable(None).wait_for_checkpoint() is None


# ----------------------------------------------------------------- restorer

def restorer(tracked, buffers, calls, record=None, agreed=None):
    return Restorer(tracked=tracked, buffers=buffers, digests=Digests(), record=record or CommitRecord(),
                    rewind_policies=lambda: calls.append("policies rewound"), agreed=lambda: agreed)


def test_the_restorer_defers_only_large_objects_that_nothing_reads_before_the_join():
    calls = []
    tracked, buffers = committed({"table": np.zeros(LARGE, np.float32), "small": np.zeros(4),
                                  "sampler": ElasticPartitioner(LARGE, global_batch_size=8, world=lambda: (0, 1))})
    part = restorer(tracked, buffers, calls)
    applied = []
    original = tracked.apply

    def noted(name, entry):
        applied.append((name, threading.current_thread() is threading.main_thread()))
        original(name, entry)

    tracked.apply = noted
    tracked.objects["table"][:] = 1.0
    tracked.objects["small"][:] = 2.0
    part.restore(background=True)
    # Back before restore returns: the small entry and the sampler, on the calling thread (the table may be too).
    assert sorted(name for name, on_main in applied if on_main) == ["sampler", "small"]
    assert not part.may_restore_later("sampler") and part.may_restore_later("table")
    assert tracked.objects["small"].tolist() == [0.0] * 4
    assert part.background is not None and calls == ["policies rewound"]
    assert part.settle_restore() >= 0.0 and part.background is None
    assert ("table", False) in applied and not tracked.objects["table"].any()
    assert part.settle_restore() is None  # nothing under way any more


def test_the_restorer_refuses_before_any_commit_and_replays_the_agreed_commit():
    calls = []
    tracked = Tracked({"weights": np.arange(3.0)}, (), ())
    empty = restorer(tracked, CommitBuffers(1), calls)
    with pytest.raises(NotCommittedError, match="before any commit"):
        empty.restore()
    assert calls == []

    tracked, buffers = committed({"weights": np.arange(3.0)})
    agreed = AgreedCommit()
    agreed.keep(buffers.entries, 3)
    record = CommitRecord(commit_id=5, generation=1)
    part = restorer(tracked, buffers, calls, record=record, agreed=agreed)
    tracked.objects["weights"][:] = 9.0
    buffers.copy(tracked.capture())  # commit 5 holds the 9s
    part.replay_from_agreed()
    assert tracked.objects["weights"].tolist() == [0.0, 1.0, 2.0]
    assert (record.commit_id, record.generation) == (3, 2) and calls == ["policies rewound"]


# ---------------------------------------------------------- the delegation

def test_a_delegated_method_is_the_parts_own_on_the_state_and_on_its_class():
    class Part:
        def greet(self, name):
            """Greets ``name``."""
            return f"{id(self)} greets {name}"

    class Host:
        greet = Delegated("_part", Part.greet)

        def __init__(self):
            self._part = Part()

    host = Host()
    mine = f"{id(host._part)} greets"
    assert host.greet("a") == f"{mine} a" and Host.greet(host, "b") == f"{mine} b"
    assert Host.greet.__doc__ == "Greets ``name``." and str(inspect.signature(host.greet)) == "(name)"
    host.greet = lambda name: "shadowed"  # like a method, an instance attribute shadows it
    assert host.greet("c") == "shadowed"
    state = state_on(SoloBinding(), step=0)
    assert state.on_reset.__self__ is state._listener and state.restore.__self__ is state._restorer


# ------------------------------------------------------------------ soft failures (policies/soft_failures.py)

def test_the_soft_failure_part_checks_a_step_with_the_binding_of_that_moment_and_only_the_samplers():
    from elastic_ext.policies.soft_failures import SoftFailures

    class Guarded:
        def step(self, binding, objects, samplers, loss, grads, samples, step):
            seen.append((binding, sorted(objects), list(samplers), loss, samples, step))
            return "verdict"

    class Straggler:
        timer = "the timer"

    seen, bindings = [], [SoloBinding()]
    tracked = Tracked({"sampler": WorldWatcher([]), "epoch": 0}, (), ())
    part = SoftFailures(guard="the guard", guarded=Guarded(), straggler=Straggler(), tracked=tracked,
                        binding=lambda: bindings[0])
    assert (part.guard, part.step_timer) == ("the guard", "the timer")
    bindings[0] = SoloBinding()  # a test may move the State to another world after building it
    assert part.guard_step(1.5, samples=8, step=3) == "verdict"
    assert seen == [(bindings[0], ["epoch", "sampler"], ["sampler"], 1.5, 8, 3)]
    state = state_on(SoloBinding(), epoch=0)
    assert state.guard is None and state.step_timer is state._soft.step_timer
    assert "guard_step" in dir(state) and "guard_step" in type(state).__dict__

"""The stall check's decision and the phase API, in one process."""

import importlib
import threading

import pytest

from elastic_ext.worker import sigterm
from elastic_ext.runtime import watchdog
from elastic_ext import liveness


def verdict(idle_s, *, stall=3.0, phases=(), training=True, collective=False):
    return watchdog.stall_verdict(idle_s, stall, list(phases), training, collective)


def test_a_step_longer_than_the_stall_timeout_is_a_stall():
    assert "stall_timeout_s=3.0" in verdict(3.5)
    assert verdict(2.5) is None


@pytest.mark.parametrize("kwargs", [dict(phases=["eval"]), dict(training=False), dict(collective=True)])
def test_no_stall_in_a_phase_outside_training_or_in_a_collective(kwargs):
    assert verdict(1000.0, **kwargs) is None


def test_a_zero_stall_timeout_turns_the_check_off():
    assert verdict(1e6, stall=0.0) is None


def test_a_main_thread_that_moves_or_computes_is_active_and_a_blocked_one_is_not():
    """An evaluation of an hour outside phase() moves, a C call computes; a deadlock does neither."""
    import numpy as np
    from elastic_ext.runtime.activity import MainThread

    def sampled(main_work, window_s=0.6):
        main, seen, inside, done = MainThread(), [], threading.Event(), threading.Event()

        def sample():
            import time
            inside.wait(10)  # the first sample once the main thread is in its work
            main.moved(time.monotonic())
            threading.Event().wait(window_s)
            seen.append(main.moved(time.monotonic()))
            done.set()

        thread = threading.Thread(target=sample)
        thread.start()
        main_work(inside, done)
        thread.join()
        return seen[0]

    def compute(inside, done):  # C calls that release the GIL and compute in this thread, repeated
        a = np.random.default_rng(0).random(1 << 20)
        inside.set()
        while not done.is_set():
            a = np.sin(a) + 1.0

    def blocked(inside, done):  # a wait nobody ends early, for the whole sampling window
        inside.set()
        done.wait(10)

    assert sampled(compute) is True
    assert sampled(blocked) is False


def test_time_in_which_the_main_thread_moved_is_not_idle():
    from elastic_ext.config import ElasticConfig
    live = liveness.Liveness()
    dog = watchdog.Watchdog(ElasticConfig(stall_timeout_s=3.0, hang_timeout_s=0), liveness=live)
    with live.training():
        t0 = live.last_progress
        for second in range(1, 60):  # a minute of evaluation with no progress, outside any phase
            assert dog.stall_check(t0 + second, in_collective=False, moved=True) is None
        assert dog.stall_check(t0 + 61, in_collective=False) is None
        assert "stall_timeout_s=3.0" in dog.stall_check(t0 + 62.1, in_collective=False)


def test_phases_nest_and_close_on_error():
    assert liveness.open_phases() == []
    with liveness.phase("eval"):
        with liveness.phase("checkpoint"):
            assert liveness.open_phases() == ["eval", "checkpoint"]
        assert liveness.open_phases() == ["eval"]
    with pytest.raises(RuntimeError):
        with liveness.phase("eval"):
            raise RuntimeError("boom")
    assert liveness.open_phases() == []


def test_a_phase_needs_a_name():
    with pytest.raises(ValueError, match=r"phase name \(''\) must be a non-empty string"):
        with liveness.phase(""):
            pass


def test_leaving_a_phase_counts_as_progress():
    liveness.LIVENESS.last_progress = 0.0
    with liveness.phase("eval"):
        pass
    assert liveness.LIVENESS.last_progress > 0.0
    assert threading.current_thread() is threading.main_thread()


def test_a_long_wait_in_a_collective_gives_a_fresh_stall_timeout_after_it():
    # A rank waits 9 s in an allreduce for a peer's evaluation, then needs a few
    # ms to reach its next record_step. A tick in those ms must not kill it.
    from elastic_ext.config import ElasticConfig
    live = liveness.Liveness()
    dog = watchdog.Watchdog(ElasticConfig(stall_timeout_s=3.0, hang_timeout_s=0), liveness=live)
    with live.training():
        live.progress()
        t0 = live.last_progress
        for second in range(1, 10):
            assert dog.stall_check(t0 + second, in_collective=True) is None
        assert dog.stall_check(t0 + 9.01, in_collective=False) is None  # just out of the wait
        assert dog.stall_check(t0 + 11.9, in_collective=False) is None
        verdict_after = dog.stall_check(t0 + 12.1, in_collective=False)  # 3.1 s outside with no progress
        assert verdict_after is not None and "stall_timeout_s=3.0" in verdict_after



def sample_while(main_work):
    """Runs ``main_work`` on the main thread while another thread samples
    whether the stall check would see it waiting or failing."""
    seen = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(watchdog._main_thread_waits_or_fails())
            stop.wait(0.02)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        main_work()
    finally:
        stop.set()
        thread.join()
    return seen


def test_a_main_thread_in_plain_python_is_neither_waiting_nor_failing():
    seen = sample_while(lambda: threading.Event().wait(0.4))
    assert seen and not any(seen), seen


def test_a_main_thread_handling_a_failed_steps_exception_is_not_a_stall():
    # A collective failed; Keras builds its filtered traceback in an except
    # block for seconds on a loaded machine. A keras3 zoo rank was killed as
    # stuck there, and the kill took the last healthy slot of the job.
    def failing_step():
        try:
            raise RuntimeError("Horovod has been shut down")
        except RuntimeError:
            threading.Event().wait(0.4)  # the traceback's slow processing

    seen = sample_while(failing_step)
    assert seen and sum(seen) >= len(seen) // 2, seen


def test_a_reset_among_running_workers_waits_the_collective_timeout_and_one_that_may_meet_starters_longer(monkeypatch):
    import importlib
    from elastic_ext.config import ConfigError, ElasticConfig
    timeouts = importlib.import_module("elastic_ext.worker.gloo_timeout")
    monkeypatch.setattr(timeouts, "_TIMEOUT_SET_AT_IMPORT", None)
    launched = {"ELASTIC_EXT_LAUNCHER": "1", "ELASTIC_EXT_MIN_NP": "2"}
    config = ElasticConfig()
    env = dict(launched)
    assert timeouts.reset_timeout(config, 4, env) == "30"          # 3 survivors >= --min-np: running workers only
    assert timeouts.reset_timeout(config, 2, env) == "120"         # 1 survivor < --min-np: new workers start cold
    assert timeouts.reset_timeout(config, 4, {}) == "120"          # plain horovodrun: newcomers may start cold
    env = {**launched, "HOROVOD_GLOO_TIMEOUT_SECONDS": "45"}
    assert timeouts.reset_timeout(config, 4, env) == "45"          # the user's value stays
    env = dict(launched)
    assert timeouts.reset_timeout(ElasticConfig(collective_timeout_s=0), 4, env) is None and "HOROVOD_GLOO_TIMEOUT_SECONDS" not in env
    assert ElasticConfig.from_env({"ELASTIC_EXT_COLLECTIVE_TIMEOUT_S": "600"}).collective_timeout_s == 600
    with pytest.raises(ConfigError, match=r"collective_timeout_s \(-1"):
        ElasticConfig(collective_timeout_s=-1)
    with pytest.raises(ConfigError, match=r"ELASTIC_EXT_MIN_NP \('two'\) must be an integer"):
        timeouts.reset_timeout(config, 4, {**launched, "ELASTIC_EXT_MIN_NP": "two"})


def test_a_newcomers_first_init_waits_as_long_as_the_survivors_resets(monkeypatch):
    """Found by bench.soak: a newcomer's first hvd.init() gave up on a peer after Horovod's
    30 s ("Wait timeout after 30 seconds") while the survivors waited 120 s for it."""
    import importlib
    from elastic_ext.config import ElasticConfig
    timeouts = importlib.import_module("elastic_ext.worker.gloo_timeout")
    monkeypatch.setattr(timeouts, "_TIMEOUT_SET_AT_IMPORT", None)
    env = {"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S": "200"}
    assert timeouts.first_rendezvous_timeout(env) == "200" and env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "200"
    # A config given in code replaces what the import set; the user's own variable is never touched.
    assert timeouts.reset_timeout(ElasticConfig(rendezvous_timeout_s=90), 4, env) == "90"
    assert timeouts.first_rendezvous_timeout({"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "45"}) is None
    assert timeouts.first_rendezvous_timeout({}) is None  # not an elastic horovodrun worker
    assert timeouts.first_rendezvous_timeout({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S": "x"}) is None


def test_a_collective_failing_before_the_first_sync_is_survived(monkeypatch):
    # Found by bench.soak: a fresh process (a newcomer, a restarted job) whose
    # first collective (learning the connections, before any sync) failed
    # crashed in restore() with NotCommittedError, an extra failure for the job.
    from horovod.common.exceptions import HorovodInternalError

    import elastic_ext
    run_module = importlib.import_module("elastic_ext.runtime.run")  # (the package loads it lazily)
    from elastic_ext.config import ElasticConfig
    from elastic_ext.runtime.connections import CollectiveConnections
    from elastic_ext.testing import SoloBinding, state_on

    failures = [HorovodInternalError("peer gone during the rendezvous")]

    def learn(self, binding):
        if failures:
            raise failures.pop()
        return 0

    monkeypatch.setattr(run_module, "controller", lambda binding: "gloo")
    monkeypatch.setattr(CollectiveConnections, "learn_from_peers", learn)
    state = state_on(SoloBinding(), config=ElasticConfig(hang_timeout_s=0), step=0)
    assert not state.committed

    @elastic_ext.run
    def train(state):
        state.step += 1
        state.commit()
        return state.step

    assert train(state) == 1 and state.committed and state.binding.resets == 1
    assert [e["event"] for e in state.events.history if e["event"] in ("rollback", "sync")] == ["rollback", "sync"]


# A child process for each SIGTERM case: the default action would end pytest itself.
_SIGTERM_CHILD = r"""
import os, signal, sys, time
import elastic_ext
from elastic_ext.worker import sigterm
from elastic_ext.runtime import watchdog
from elastic_ext import liveness
case = sys.argv[1]
if case == "in_run_outside_training":  # between two resets: not in training, inside run()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sigterm.install_sigterm(elastic_ext.ElasticConfig(term_grace_s=float(sys.argv[2])))
print("handler", getattr(signal.getsignal(signal.SIGTERM), "elastic_ext_sigterm", False), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("alive", liveness.LIVENESS.leaving(), liveness.LIVENESS.in_training, flush=True)
if case == "twice":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("survived a second SIGTERM", flush=True)
elif case == "after_run":
    previous = sigterm.install_sigterm(elastic_ext.ElasticConfig())
    sigterm.restore_sigterm(previous)
    print("after run", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
else:
    time.sleep(30)  # no commit comes: term_grace_s ends it
print("not ended", flush=True)
"""


def _sigterm_child(case, *args, **env):
    """Runs the child through the launcher's entry module, as elastic-horovodrun starts a worker."""
    import os
    import subprocess
    import sys
    import tempfile
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ELASTIC_EXT_"))}
    environ.update(env)
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "child.py")
        with open(script, "w") as handle:
            handle.write(_SIGTERM_CHILD)
        return subprocess.run([sys.executable, "-m", "elastic_ext.worker.entry", script, case, *args], env=environ,
                              capture_output=True, text=True, timeout=120)


def test_a_sigterm_before_run_asks_to_leave_instead_of_killing_a_newcomer():
    """Found by bench.soak (2 of 5 job deaths in one run): a newcomer SIGTERMed between its start and
    @elastic_ext.run died ("Terminated", exit 143) while its round of the rendezvous formed; the
    round's other members then waited for it and failed, and Horovod's driver ended the job."""
    done = _sigterm_child("grace", HOROVOD_ELASTIC="1", ELASTIC_EXT_TERM_GRACE_S="1")
    assert done.stdout.splitlines()[:2] == ["handler True", "alive True False"], done.stdout + done.stderr
    assert "not ended" not in done.stdout
    assert done.returncode == 143, "term_grace_s without a commit ends it with the leave's exit code"
    assert "no commit within term_grace_s" in done.stderr


def test_a_second_sigterm_ends_the_process_at_once():
    import signal
    done = _sigterm_child("twice", HOROVOD_ELASTIC="1")
    assert done.stdout.splitlines() == ["handler True", "alive True False"], done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


def test_a_sigterm_between_resets_inside_run_asks_to_leave():
    """In run() but not in training (the sync, or right after Horovod's native re-initialisation
    returned) SIGTERM used to keep its default meaning: the worker died just as its round formed."""
    done = _sigterm_child("in_run_outside_training", "1")
    assert done.stdout.splitlines()[:2] == ["handler True", "alive True False"], done.stdout + done.stderr
    assert done.returncode == 143


def test_sigterm_keeps_its_default_meaning_outside_an_elastic_horovodrun_and_after_run():
    import signal
    done = _sigterm_child("grace")  # no HOROVOD_ELASTIC: the entry module installs nothing
    assert done.stdout.splitlines() == ["handler False"] and done.returncode == -signal.SIGTERM, done.stdout
    done = _sigterm_child("after_run", HOROVOD_ELASTIC="1")
    assert done.stdout.splitlines()[-2:] == ["after run True", "not ended"], done.stdout + done.stderr


def test_the_scripts_own_sigterm_handler_is_kept_at_import():
    import signal
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        assert sigterm.install_early_sigterm({"HOROVOD_ELASTIC": "1"}) is None
        assert not getattr(signal.getsignal(signal.SIGTERM), "elastic_ext_sigterm", False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sigterm.install_early_sigterm({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_TERM_GRACE_S": "x"}) is None


def test_a_lost_guardian_is_an_event_and_the_heartbeat_goes_on(tmp_path):
    """The guardian killed under a running watchdog: a ``guardian_lost`` event in the event log, as run() wires it."""
    import signal

    from elastic_ext import events
    from elastic_ext.config import ElasticConfig

    path = str(tmp_path / "events-{rank}.jsonl")
    log = events.EventLog(path, rank_fn=lambda: 0, size_fn=lambda: 1)
    reported = threading.Event()

    def lost(code, error):  # what elastic_ext.runtime.run passes, plus a signal for this test
        log.emit(events.GUARDIAN_LOST, exit_code=code, error=error)
        reported.set()

    dog = watchdog.Watchdog(ElasticConfig(stall_timeout_s=0, hang_timeout_s=30), liveness=liveness.Liveness(),
                            on_guardian_lost=lost)
    dog.period_s = 0.05
    dog.start()
    try:
        guardian = dog._guardian
        assert guardian is not None and guardian.poll() is None, "a hang timeout starts a guardian"
        guardian.kill()
        guardian.wait(timeout=10)
        assert reported.wait(timeout=10), "the heartbeat thread reports the lost guardian"
        assert dog._thread.is_alive(), "the heartbeat (and the stall check) go on without it"
    finally:
        dog.stop()
    written = [e for e in events.read_events(path.replace("{rank}", "0")) if e["event"] == events.GUARDIAN_LOST]
    assert len(written) == 1, written
    assert written[0]["exit_code"] == -signal.SIGKILL
    assert "BrokenPipeError" in written[0]["error"] or "OSError" in written[0]["error"], written[0]["error"]


def test_run_reports_a_lost_guardian_as_an_event():
    """The wiring: run() gives its Watchdog a callback that emits ``guardian_lost`` (read from its source)."""
    import ast
    import inspect

    from elastic_ext.runtime import run as run_module

    calls = [node for node in ast.walk(ast.parse(inspect.getsource(run_module)))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Watchdog"]
    assert len(calls) == 1
    lost = [k.value for k in calls[0].keywords if k.arg == "on_guardian_lost"]
    assert lost and "GUARDIAN_LOST" in ast.unparse(lost[0]), ast.unparse(calls[0])

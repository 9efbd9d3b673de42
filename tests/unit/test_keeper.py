"""The keeper (elastic_ext.worker.keeper): which ends of its child it restarts, and how it ends otherwise.

Each test runs a small script in a fresh interpreter with the environment
of an elastic horovodrun worker and ELASTIC_EXT_RESTART_IN_PLACE=1. The
script's process is the keeper's child; what it does depends on how many
times it was restarted (ELASTIC_EXT_RESTARTED_IN_PLACE).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from elastic_ext.worker import keeper
from elastic_ext.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import os, signal, sys, time
import elastic_ext
from elastic_ext.worker import keeper
n = keeper.restarts()
out = sys.argv[1]
with open(os.path.join(out, f"child-{n}"), "w") as f:
    f.write(str(os.getpid()))
"""


def run_script(tmp_path, body, env_extra=None, timeout=60):
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ELASTIC_EXT_"))}
    env.update({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_RESTART_IN_PLACE": "1", "PYTHONPATH": ROOT, **(env_extra or {})})
    # the launcher's entry module: it makes this process the keeper before the script runs
    proc = subprocess.run([sys.executable, "-m", "elastic_ext.worker.entry", str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True,
                          timeout=timeout)
    children = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("child-"))
    return proc, children


def test_a_child_aborted_inside_hvd_init_is_restarted_and_its_exit_is_the_keepers(tmp_path):
    proc, children = run_script(tmp_path, """
        if n < 2:
            keeper.enter_init()
            os.abort()          # Gloo's std::terminate inside hvd.init()
        keeper.leave_init(joined=True)
        sys.exit(7)
    """)
    assert children == ["child-0", "child-1", "child-2"], proc.stderr
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.count("restarting it in place") == 2


def test_an_abort_outside_hvd_init_ends_the_keeper_with_sigabrt(tmp_path):
    proc, children = run_script(tmp_path, """
        keeper.enter_init()
        keeper.leave_init(joined=True)
        os.abort()
    """)
    assert children == ["child-0"]
    assert proc.returncode == -signal.SIGABRT
    assert "restarting" not in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_child_killed_inside_hvd_init_by_another_signal_is_not_restarted(tmp_path, sig):
    proc, children = run_script(tmp_path, f"""
        keeper.enter_init()
        os.kill(os.getpid(), {int(sig)})
    """)
    assert children == ["child-0"]
    assert proc.returncode == -sig


def test_the_keeper_gives_up_on_a_child_that_never_joins(tmp_path):
    # A worker whose host Horovod removed aborts in every hvd.init(): after
    # MAX_RESTARTS_WITHOUT_JOINING restarts the keeper ends as its child did.
    proc, children = run_script(tmp_path, """
        keeper.enter_init()
        os.abort()
    """)
    assert len(children) == keeper.MAX_RESTARTS_WITHOUT_JOINING + 1
    assert proc.returncode == -signal.SIGABRT


def test_a_child_that_joined_in_between_resets_the_count(tmp_path):
    limit = keeper.MAX_RESTARTS_WITHOUT_JOINING
    proc, children = run_script(tmp_path, f"""
        if n == {limit}:
            keeper.enter_init(); keeper.leave_init(joined=True)   # a real hvd.init() completed
        keeper.enter_init()
        if n < {2 * limit + 1}:
            os.abort()
        sys.exit(0)
    """)
    assert len(children) == 2 * limit + 2, proc.stderr
    assert proc.returncode == 0


def test_rounds_lost_one_after_the_other_do_not_use_up_the_restarts(tmp_path):
    # Newcomers killed one after the other while they start break a round each
    # time; each ends the other workers' wait (round_watch). Before, their
    # keepers gave up at the third restart. A later round each time is the
    # driver moving on: those restarts have their own, larger limit.
    rounds = 2 * (keeper.MAX_RESTARTS_WITHOUT_JOINING + 1)
    assert rounds <= keeper.MAX_LOST_ROUNDS_WITHOUT_JOINING
    proc, children = run_script(tmp_path, f"""
        keeper.enter_init()
        if n < {rounds}:
            keeper.lost_round(10 + n)
        keeper.leave_init(joined=True)
        sys.exit(3)
    """)
    assert len(children) == rounds + 1, proc.stderr
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.count("a member of round") == rounds


def test_the_same_round_lost_again_counts_as_a_restart_without_joining(tmp_path):
    proc, children = run_script(tmp_path, """
        keeper.enter_init()
        keeper.lost_round(5)
    """)
    # The first loss of round 5 is progress; each later one is not.
    assert len(children) == keeper.MAX_RESTARTS_WITHOUT_JOINING + 2, proc.stderr
    assert proc.returncode == -signal.SIGABRT


def test_the_keeper_gives_up_after_too_many_lost_rounds_without_joining(tmp_path):
    proc, children = run_script(tmp_path, """
        keeper.enter_init()
        keeper.lost_round(n)
    """)
    assert len(children) == keeper.MAX_LOST_ROUNDS_WITHOUT_JOINING + 1, proc.stderr
    assert proc.returncode == -signal.SIGABRT


def ignored_signals(pid):
    """The mask of signals process ``pid`` ignores (SigIgn in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)


def test_the_keeper_ignores_sigterm_and_the_child_dies_with_the_keeper(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + "time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ELASTIC_EXT_"))}
    env.update(HOROVOD_ELASTIC="1", ELASTIC_EXT_RESTART_IN_PLACE="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ext.worker.entry", str(script), str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child-0").exists() or not (tmp_path / "child-0").read_text():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        child = int((tmp_path / "child-0").read_text())
        assert child != proc.pid
        assert ignored_signals(proc.pid) & (1 << (signal.SIGTERM - 1)), "the keeper does not ignore SIGTERM"
        proc.send_signal(signal.SIGTERM)  # an ignored signal is discarded when sent: nothing to wait for
        assert proc.poll() is None, "the keeper must not die of SIGTERM"
        os.kill(child, 0)  # the child is alive too
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the child outlived its keeper"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_keeper_unless_asked_in_an_elastic_worker(tmp_path):
    proc, _ = run_script(tmp_path, "print(os.getppid())\n", env_extra={"ELASTIC_EXT_RESTART_IN_PLACE": "0"})
    assert proc.returncode == 0
    assert int(proc.stdout.strip()) == os.getpid(), "no keeper: the script is the process that was started"
    assert keeper.install({"ELASTIC_EXT_RESTART_IN_PLACE": "1"}) is False  # not an elastic horovodrun worker


def test_a_bad_value_names_itself():
    with pytest.raises(ConfigError, match="ELASTIC_EXT_RESTART_IN_PLACE.*'sometimes'"):
        keeper.install({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_RESTART_IN_PLACE": "sometimes"})


def test_a_process_the_script_starts_gets_no_keeper_of_its_own(tmp_path):
    # The guardian sidecar imports elastic_ext too: it must stay the child of the
    # script's process, or it cannot guard it (it only ever kills its parent).
    proc, children = run_script(tmp_path, """
        import subprocess
        code = "import os, elastic_ext; print(os.getpid(), os.getppid())"
        pid, ppid = map(int, subprocess.check_output([sys.executable, "-c", code]).split())
        sys.exit(0 if ppid == os.getpid() else 3)
    """)
    assert proc.returncode == 0, proc.stderr
    assert children == ["child-0"]

"""The guardian sidecar with real processes: it kills only its own parent, and a
suspension of the whole job (guardian included) is not taken for a hang."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in for a worker: starts its guardian like elastic_ext.runtime.watchdog does,
# prints the guardian's pid, then beats every 0.2 s, printing "beat" after each
# (or never, with "silent").
WORKER = textwrap.dedent("""
    import subprocess, sys, time
    guardian = subprocess.Popen([sys.executable, "-m", "elastic_ext.runtime.guardian", "--pid", str(__import__("os").getpid()),
                                 "--timeout-s", sys.argv[1]], stdin=subprocess.PIPE)
    print(guardian.pid, flush=True)
    if sys.argv[2] == "fork-and-exit":
        child = __import__("os").fork()
        if child == 0:
            time.sleep(60)  # holds guardian.stdin open
        print(child, flush=True)
        __import__("os")._exit(0)
    if sys.argv[2] == "hold-the-gil":  # beats, then computes in the main thread without beating, then blocks
        for _ in range(3):
            time.sleep(0.2)
            guardian.stdin.write(b"."); guardian.stdin.flush()
        print("computing", flush=True)
        end = time.monotonic() + float(sys.argv[3])
        while time.monotonic() < end:  # the heartbeat does not run, the CPU does
            sum(range(10000))
        print("blocked", flush=True)
        time.sleep(60)
    while True:
        time.sleep(0.2)
        if sys.argv[2] == "beat":
            guardian.stdin.write(b"."); guardian.stdin.flush()
            print("beat", flush=True)
""")


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start_worker(timeout_s, mode, *args):
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(timeout_s), mode, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env())
    guardian = psutil.Process(int(proc.stdout.readline()))
    return proc, guardian


def beats(worker, count):
    """Reads the next ``count`` heartbeats the worker sent its guardian (fails if the worker dies first)."""
    for _ in range(count):
        line = worker.stdout.readline()
        assert line == b"beat\n", f"the worker stopped beating (exit status {worker.poll()})"


def stop(procs):
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


@pytest.mark.timeout(60)
def test_a_guardian_never_kills_a_pid_that_is_not_its_parent():
    # The pid a guardian was told to watch now belongs to some other process
    # (what pid reuse looks like from the guardian): it must not be touched.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    guardian = subprocess.Popen([sys.executable, "-m", "elastic_ext.runtime.guardian", "--pid", str(bystander.pid),
                                 "--timeout-s", "1"], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    try:
        _, err = guardian.communicate(timeout=20)  # its stdin stays open: no EOF, no heartbeat
        assert guardian.returncode == 2, err
        assert b"not this guardian's parent" in err, err
        assert bystander.poll() is None, "the guardian killed a process that is not its parent"
    finally:
        stop([bystander, guardian])


@pytest.mark.timeout(60)
def test_a_stopped_worker_is_killed_by_its_guardian():
    worker, guardian = start_worker(1.0, "beat")
    try:
        beats(worker, 8)  # 1.6 s of heartbeats, longer than the guardian's timeout
        assert worker.poll() is None, "a beating worker was killed"
        worker.send_signal(signal.SIGSTOP)
        assert worker.wait(timeout=20) == -signal.SIGKILL
    finally:
        stop([worker, guardian])


@pytest.mark.timeout(60)
def test_a_worker_that_computes_without_beating_is_not_killed_until_it_blocks():
    # A C call holding the GIL for a while (here: 3 timeouts of busy main thread, no heartbeat) is not a
    # hang; the same worker blocked with no heartbeat is.
    worker, guardian = start_worker(1.0, "hold-the-gil", "3.0")
    try:
        assert worker.stdout.readline() == b"computing\n"
        assert worker.stdout.readline() == b"blocked\n", f"killed while computing (status {worker.poll()})"
        assert worker.wait(timeout=20) == -signal.SIGKILL
        err = worker.stderr.read()
        assert b"ran on the CPU" in err and b"SIGKILL" in err, err
    finally:
        stop([worker, guardian])


@pytest.mark.timeout(60)
def test_a_guardian_leaves_when_its_worker_is_gone_even_if_a_child_keeps_the_pipe_open():
    # A DataLoader-like child inherited the heartbeat pipe, so no EOF comes when
    # the worker dies; the worker's pid may be reused: the guardian must go.
    worker, guardian = start_worker(30.0, "fork-and-exit")
    keeper = None
    try:
        keeper = psutil.Process(int(worker.stdout.readline()))
        assert worker.wait(timeout=10) == 0
        guardian.wait(timeout=10)  # far less than its 30 s timeout
        assert keeper.is_running(), "the child holding the pipe must be left alone"
    finally:
        stop([worker, guardian] + ([keeper] if keeper else []))


@pytest.mark.timeout(90)
def test_suspending_worker_and_guardian_together_kills_nobody():
    # Slurm suspend: every process of the job is stopped, then continued, in
    # no particular order: here the guardian wakes first and sees no heartbeat
    # for a while, as if its worker had hung through the whole suspension.
    worker, guardian = start_worker(2.0, "beat")
    try:
        beats(worker, 3)
        for p in (worker, guardian):
            p.send_signal(signal.SIGSTOP)
        time.sleep(5.0)  # the suspension: 2.5 times the guardian's timeout
        guardian.send_signal(signal.SIGCONT)
        time.sleep(0.7)  # the guardian runs alone for a while, less than its timeout
        worker.send_signal(signal.SIGCONT)
        beats(worker, 15)  # 3 s of heartbeats after the resumption, longer than the timeout
        assert worker.poll() is None, "the guardian killed its worker after a whole-job suspension"
        assert guardian.is_running() and guardian.status() != psutil.STATUS_ZOMBIE
    finally:
        stop([worker, guardian])

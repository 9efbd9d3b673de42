"""Launching real horovodrun / mpirun jobs from tests and benchmarks, with a hard timeout.

Every launch runs in its own session; on expiry (or any exit) the whole
process tree (horovodrun, its middlemen and every worker, which Horovod puts
in process groups of their own) is killed, found through psutil. Paths are
those of the checkout this package sits in (its tests' workers, its
``host_discovery/static.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import psutil

from elastic_ext.control import horovod_seam

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)
WORKERS = os.path.join(REPO, "tests", "multiprocess", "workers")
STATIC = os.path.join(REPO, "host_discovery", "static.py")
# How test and benchmark commands start plain Horovod: the ``horovodrun`` script by default;
# the test suite sets CACHED_CHECKS (tests/conftest.py, see elastic_ext.launch.plain_horovodrun).
HOROVODRUN_SCRIPT = [os.path.join(VENV_BIN, "horovodrun")]
CACHED_CHECKS = [sys.executable, "-m", "elastic_ext.launch.plain_horovodrun"]
RUNNER = HOROVODRUN_SCRIPT
# Every process of a Job inherits this variable, set to the job's own tag, so
# that the job's processes are found at its end even when nobody saw them
# start (Horovod runs each worker in a session of its own, and a worker whose
# parent died is nobody's descendant any more).
JOB_TAG_ENV = "TEST_JOB_TAG"  # not ELASTIC_EXT_*: the config refuses variables it does not know
# How often a waiting Job lists its descendants: a full scan of /proc, which
# on a busy machine costs milliseconds each time.
TRACK_PERIOD_S = 1.0


def base_env(**extra: Any) -> Dict[str, str]:
    """This environment plus what every launched job needs (venv first on PATH, the checkout on PYTHONPATH)."""
    env = dict(os.environ)
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    # Bitwise comparisons between runs need a fixed reduction order. With
    # tensor fusion, which gradients share a fusion buffer depends on timing,
    # and with more than two ranks the ring's chunking (so the summation
    # order) follows the buffer layout: runs then differ in the last bits.
    env.setdefault("HOROVOD_FUSION_THRESHOLD", "0")
    # Horovod's background loop coordinates the ranks once a cycle, busy or
    # not: at its default of 1 ms an idle worker takes about 9 % of a core,
    # at 5 ms 2 % (docs/testing.md), and the jobs here run 4 to 6 workers on
    # 2 cores. Horovod 0.28.1 as released crashes in the hvd.init() after a
    # reset when both values are set (elastic_ext.launch.horovodrun says
    # why): only where its build carries the fix.
    if horovod_seam.TUNING_FIX in horovod_seam.build_patches():
        env.setdefault("HOROVOD_CYCLE_TIME", "5")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and every descendant, and waits for them."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def command_line(proc: psutil.Process) -> List[str]:
    """``proc``'s command line, or an empty one once it ended (a short-lived child may end while a test lists it)."""
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def script_process(worker: psutil.Process) -> psutil.Process:
    """The process running a worker's script: ``worker`` itself, or its child when ``worker`` is its keeper.

    When the job restarts workers in place the process Horovod's driver
    started (the keeper, :mod:`elastic_ext.worker.keeper`) forks the script's
    process, with the same command line.
    """
    try:
        for child in worker.children():
            if child.cmdline() == worker.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                return child
    except psutil.NoSuchProcess:
        pass
    return worker


def kill_worker(pid: int) -> None:
    """SIGKILLs a worker as a lost machine would: the script's process ``pid`` and its keeper, if it has one."""
    proc = psutil.Process(pid)
    parent = proc.parent()
    targets = [proc]
    if parent is not None and parent.cmdline() == proc.cmdline():
        targets.insert(0, parent)
    for target in targets:
        try:
            target.kill()
        except psutil.NoSuchProcess:
            pass


def tagged(tag: str) -> List[int]:
    """The pids of the live processes whose environment holds ``JOB_TAG_ENV=tag``."""
    needle = f"{JOB_TAG_ENV}={tag}".encode() + b"\0"
    found = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if needle in handle.read():
                    found.append(pid)
        except OSError:
            pass  # gone, or not ours to read
    return found


class Job:
    """A running command whose whole tree is killed on timeout or exit."""

    def __init__(self, cmd: Sequence[str], env: Dict[str, str], log_path: str, cwd: str = REPO) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.tag = f"{os.getpid()}-{id(self)}-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(cmd, env=dict(env, **{JOB_TAG_ENV: self.tag}), cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.descendants = set()
        self._tracked_at = float("-inf")

    def track(self) -> None:
        """Adds the job's current descendants to ``descendants``."""
        self._tracked_at = time.monotonic()
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants.add(child.pid)
        except psutil.NoSuchProcess:
            pass

    def track_now_and_then(self) -> None:
        """:meth:`track`, at most once every TRACK_PERIOD_S (for polling loops)."""
        if time.monotonic() - self._tracked_at >= TRACK_PERIOD_S:
            self.track()

    def members(self) -> List[int]:
        """The pids of the job's live processes but its root: descendants seen, and every process holding its tag."""
        return sorted(({pid for pid in self.descendants if psutil.pid_exists(pid)} | set(tagged(self.tag)))
                      - {self.proc.pid})

    def stacks(self, limit_chars: int = 6000) -> str:
        """The stacks of the job's live Python processes, every thread, Python and native frames
        (``py-spy dump --native``), for the message of a test that gave up waiting: where each process
        waits, down to the lock a thread holding the GIL blocks on. The first ``limit_chars`` of each
        (the main thread comes first). Never raises."""
        spy = os.path.join(VENV_BIN, "py-spy")
        if not os.path.exists(spy):
            return "(no py-spy in the environment: no stacks)"
        parts = []
        for pid in [self.proc.pid, *self.members()]:
            try:
                line = " ".join(command_line(psutil.Process(pid)))
            except psutil.NoSuchProcess:
                continue
            if "python" not in line.split(" ", 1)[0]:
                continue  # ssh, a shell: no Python stack
            text = ""
            for native in (["--native"], []):  # without native frames where unwinding them fails
                try:
                    dump = subprocess.run([spy, "dump", *native, "--pid", str(pid)], capture_output=True,
                                          text=True, timeout=60)
                    text = (dump.stdout + dump.stderr).strip()
                except (OSError, subprocess.SubprocessError) as exc:
                    text = f"(py-spy failed: {exc})"
                    continue
                if dump.returncode == 0:
                    break
            parts.append(f"--- pid {pid}: {line[:160]}\n{text[:limit_chars]}")
        return "\n".join(parts) or "(no live Python process)"

    def kill(self) -> None:
        """SIGKILLs the whole tree and every worker orphaned from it, and closes the log."""
        kill_tree(self.proc.pid)
        for pid in self.members():
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()

    def wait(self, timeout_s: float) -> Tuple[int, str]:
        """Waits for the end (killing the tree at ``timeout_s``); returns (exit code, output)."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track_now_and_then()
            time.sleep(0.2)
        timed_out = self.proc.poll() is None
        stacks = self.stacks() if timed_out else ""
        self.kill()
        output = open(self.log_path).read()
        if timed_out:
            raise AssertionError(f"job timed out after {timeout_s}s and was killed; output tail:\n{output[-6000:]}\n"
                                 f"stacks before the kill:\n{stacks}")
        return self.proc.returncode, output


def run(cmd: Sequence[str], env: Dict[str, str], log_path: str, timeout_s: float) -> Tuple[int, str]:
    """Runs ``cmd`` to its end or ``timeout_s`` (then AssertionError); returns (exit code, output)."""
    return Job(cmd, env, log_path).wait(timeout_s)


def write_hosts(path: str, lines: Sequence[str]) -> None:
    """Replaces a discovery host file at once (the driver never reads half of it)."""
    with open(path + ".tmp", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def elastic_cmd(np_: int, min_np: int, max_np: int, hosts_file: str, script: str, *script_args: str,
                nics: str = "lo") -> List[str]:
    """horovodrun, elastic on the host file, running a test worker (its collectives on ``nics``)."""
    return [*RUNNER, "-np", str(np_), "--min-np", str(min_np),
            "--max-np", str(max_np), "--host-discovery-script", f"{STATIC} {hosts_file}",
            "--network-interfaces", nics, sys.executable, os.path.join(WORKERS, script), *script_args]


def under_elastic_ext_driver(cmd: Sequence[str]) -> List[str]:
    """A ``horovodrun`` command line run by ``python -m elastic_ext.launch.horovodrun`` instead (the same arguments)."""
    return [sys.executable, "-m", "elastic_ext.launch.horovodrun", *horovodrun_args(cmd)]


def horovodrun_args(cmd: Sequence[str]) -> List[str]:
    """The arguments of a ``horovodrun`` command line made here (what follows :data:`RUNNER`, or the script)."""
    for runner in (RUNNER, CACHED_CHECKS, HOROVODRUN_SCRIPT):
        if list(cmd[:len(runner)]) == runner:
            return list(cmd[len(runner):])
    return list(cmd[1:])


def with_options(cmd: Sequence[str], options: Sequence[str]) -> List[str]:
    """A ``horovodrun`` command line made here, with ``options`` before its other arguments."""
    args = horovodrun_args(cmd)
    return list(cmd[:len(cmd) - len(args)]) + list(options) + args


def static_cmd(np_: int, script: str, *script_args: str) -> List[str]:
    """horovodrun with a fixed world of ``np_`` local Gloo workers, running a test worker."""
    return [*RUNNER, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
            "--network-interfaces", "lo", sys.executable, os.path.join(WORKERS, script), *script_args]


def third_host() -> str:
    """A third name for this machine that Horovod runs locally (no ssh), beside ``localhost`` and ``127.0.0.1``.

    The hostname if it resolves to one of this machine's IPv4 addresses,
    else a non-loopback IPv4 address of this machine.

    Raises:
        RuntimeError: neither exists; the message lists the addresses seen.
    """
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    try:
        if socket.gethostbyname(socket.gethostname()) in local:
            return socket.gethostname()
    except OSError:
        pass
    others = sorted(a for a in local if not a.startswith("127."))
    if not others:
        raise RuntimeError(f"no third local host name: {socket.gethostname()!r} does not resolve to one of "
                           f"this machine's addresses {sorted(local)}, and none of them is outside 127.0.0.0/8")
    return others[0]


__all__ = ["REPO", "VENV_BIN", "WORKERS", "STATIC", "JOB_TAG_ENV", "base_env", "tagged", "kill_tree", "command_line",
           "script_process", "kill_worker", "Job", "run", "write_hosts", "elastic_cmd", "under_elastic_ext_driver",
           "static_cmd", "third_host"]

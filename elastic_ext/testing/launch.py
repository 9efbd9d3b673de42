"""Launching real horovodrun / mpirun jobs from tests, with a hard timeout.

Every launch runs in its own session; on expiry (or any exit) the whole
process tree (horovodrun, its middlemen and every worker, which Horovod puts
in process groups of their own) is killed, found through psutil.
"""

import os
import signal
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
WORKERS = os.path.join(REPO, "tests", "multiprocess", "workers")
STATIC = os.path.join(REPO, "host_discovery", "static.py")


def base_env(**extra):
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
    env.update({k: str(v) for k, v in extra.items()})
    return env


def kill_tree(pid):
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


class Job:
    """A running command whose whole tree is killed on timeout or exit."""

    def __init__(self, cmd, env, log_path, cwd=REPO):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.descendants = set()

    def track(self):
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants.add(child.pid)
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track()
            time.sleep(0.2)
        timed_out = self.proc.poll() is None
        kill_tree(self.proc.pid)
        for pid in self.descendants:  # workers orphaned from the tree
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()
        output = open(self.log_path).read()
        if timed_out:
            raise AssertionError(f"job timed out after {timeout_s}s and was killed; output tail:\n{output[-6000:]}")
        return self.proc.returncode, output


def run(cmd, env, log_path, timeout_s):
    return Job(cmd, env, log_path).wait(timeout_s)


def write_hosts(path, lines):
    with open(path + ".tmp", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def elastic_cmd(np_, min_np, max_np, hosts_file, script, *script_args):
    return [os.path.join(VENV_BIN, "horovodrun"), "-np", str(np_), "--min-np", str(min_np),
            "--max-np", str(max_np), "--host-discovery-script", f"{STATIC} {hosts_file}",
            "--network-interfaces", "lo", sys.executable, os.path.join(WORKERS, script), *script_args]


def static_cmd(np_, script, *script_args):
    return [os.path.join(VENV_BIN, "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
            "--network-interfaces", "lo", sys.executable, os.path.join(WORKERS, script), *script_args]



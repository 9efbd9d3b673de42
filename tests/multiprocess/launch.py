"""Tests launch jobs through :mod:`devkit.launch` (re-exported here),
and through the few launchers below that only tests need."""

import signal
import time

import psutil

from devkit.launch import *  # noqa: F401,F403
from devkit.launch import base_env, elastic_cmd, run, under_elastic_ext_driver, write_hosts

HOSTS = ("localhost:2", "127.0.0.1:2")  # two pseudo-hosts of two slots


def run_job(tmp_path, worker, *worker_args, hosts=HOSTS, np_=4, min_np=2, max_np=4, epochs=1, commit_every=4,
            env=None, timeout_s=240, launcher=False):
    """Runs ``worker`` (a script of tests/multiprocess/workers) under elastic horovodrun to its end
    (``launcher``: under ``elastic-horovodrun``, the project's launcher, with the same arguments).

    The job's directory is ``tmp_path/job`` (created here): the worker's
    ``--out``, its host file ``hosts`` (``hosts`` written to it), the events
    file ``events.jsonl`` (``ELASTIC_EXT_EVENTS_PATH``, with ``env`` added to
    :func:`base_env`) and ``horovodrun.log``. The worker gets ``--out``,
    ``--epochs``, ``--commit-every`` and ``worker_args``. Asserts that the job
    exits 0 within ``timeout_s``; returns (job directory, output).
    """
    out = tmp_path / "job"
    out.mkdir()
    hosts_file = str(out / "hosts")
    write_hosts(hosts_file, list(hosts))
    cmd = elastic_cmd(np_, min_np, max_np, hosts_file, worker, "--out", str(out), "--epochs", str(epochs),
                      "--commit-every", str(commit_every), *worker_args)
    if launcher:
        cmd = under_elastic_ext_driver(cmd)
    code, output = run(cmd, base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), **(env or {})),
                       str(out / "horovodrun.log"), timeout_s)
    assert code == 0, output[-5000:]
    return out, output


def kill_whole_job(job, when, timeout_s):
    """Once ``when()`` is true, SIGKILLs every process of ``job`` (a :class:`Job`), as a lost
    machine room, a node failure or ``scancel --signal=KILL`` would: the driver first, so that
    nothing reacts to the workers' death, then every process it started.

    Asserts that the job is still running while ``when()`` is false, that it becomes true
    within ``timeout_s``, and that every process died of the SIGKILL. Returns the worker
    processes found (the driver's descendants). The tree is killed and the log closed
    whatever happens.
    """
    deadline = time.monotonic() + timeout_s
    try:
        while not when():
            job.track_now_and_then()
            if job.proc.poll() is not None or time.monotonic() >= deadline:
                tail = open(job.log_path).read()[-5000:]
                assert job.proc.poll() is None, f"the job ended before it could be killed:\n{tail}"
                raise AssertionError(f"not ready to be killed after {timeout_s}s:\n{tail}")
            time.sleep(0.05)
        job.track()
        driver = psutil.Process(job.proc.pid)
        workers = []
        for pid in job.members():
            try:
                workers.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass  # ended since it was listed
        for proc in [driver] + workers:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass  # it ended between the listing and the kill (a shell whose parent just died)
        _, alive = psutil.wait_procs([driver] + workers, timeout=30)
    finally:
        job.kill()
    assert not alive, f"processes survived SIGKILL: {alive}"
    assert driver.returncode == -signal.SIGKILL, f"the driver ended with {driver.returncode}, not by SIGKILL"
    return workers

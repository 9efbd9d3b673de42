"""Jobs on the test cluster (tools/testcluster.py): the driver on ``eeh0``, workers over ssh on the others.

A job is the project's launcher (``python -m elastic_ext.launch.horovodrun``)
started in the driver's host namespace, with the same test workers, host
file discovery, ledger and events as tests/multiprocess; its collectives
run on each host's ``eth0``. Faults that the test applies from outside (a
host killed, a partition) wait for a step in the ledger, with a bound.
"""

import json
import os
import sys
import time

import psutil

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
WAIT_S = 120.0        # the bound on any one wait of a test for its job


def start(cluster, out, hosts, np_, min_np, max_np, *worker_args, worker="train_torch.py", horovodrun_args=(),
          env=None, supervise=None):
    """Starts a job under the launcher on ``cluster`` (a :class:`launch.Job`; the caller waits or kills it).

    ``hosts``: the host file's lines. ``horovodrun_args``: more launcher
    arguments. ``supervise``: arguments of ``python -m elastic_ext.launch.supervise``
    to run the job under. The job's directory ``out`` gets ``hosts``,
    ``events.jsonl`` and ``driver.log``.
    """
    out.mkdir(exist_ok=True)
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, list(hosts))
    cmd = launch.under_elastic_ext_driver(launch.elastic_cmd(
        np_, min_np, max_np, hosts_file, worker, "--out", str(out), "--commit-every", str(COMMIT_EVERY),
        *worker_args, nics="eth0"))
    cmd[3:3] = list(horovodrun_args)  # after "python -m elastic_ext.launch.horovodrun"
    if supervise is not None:
        cmd = [sys.executable, "-m", "elastic_ext.launch.supervise", *supervise, "--", *cmd]
    environment = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), **(env or {}))
    environment["PATH"] = cluster.bin + os.pathsep + environment["PATH"]  # ssh with the cluster's keys
    return launch.Job(cluster.netns(cluster.hosts[0], *cmd), environment, str(out / "driver.log"))


def wait_for(job, what, predicate, timeout_s=WAIT_S):
    """Waits until ``predicate()`` is true while ``job`` runs; fails naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        job.track()
        tail = lambda: open(job.log_path).read()[-4000:]  # noqa: E731
        assert job.proc.poll() is None, f"the job ended ({job.proc.returncode}) before {what}:\n{tail()}"
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} after {timeout_s:.0f}s:\n{tail()}\n"
                                 f"last events by process:\n{last_events(job)}\nstacks:\n{job.stacks()}")
        time.sleep(0.1)


def last_events(job, count=4):
    """The last ``count`` events of each process in the job's events file, one line each (for a failure's message)."""
    path = os.path.join(os.path.dirname(job.log_path), "events.jsonl")
    by_pid = {}
    try:
        with open(path) as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                by_pid.setdefault(event.get("pid"), []).append(event)
    except OSError:
        return "(no events file)"
    lines = []
    for pid, events in sorted(by_pid.items(), key=lambda item: str(item[0])):
        lines.append(f"pid {pid}: " + "; ".join(
            f"{e.get('time', 0):.2f} {e.get('event')} rank {e.get('rank')} size {e.get('size')}"
            for e in events[-count:]))
    return "\n".join(lines)


def events(out, name=None):
    found = analysis.read_events(str(out / "events.jsonl"))
    return [e for e in found if name is None or e["event"] == name]


def steps(out):
    return [r for r in ledger.read(str(out)) if "gen" in r]


def reached(out, step, after_gen=0):
    """A predicate: some rank recorded ``step`` (or later) in a generation above ``after_gen``."""
    return lambda: any(r["step"] >= step and r["gen"] > after_gen for r in steps(out))


def first_step_after(out, t):
    """Unix time of the first step any rank began after ``t`` in a generation that started after ``t``."""
    records = ledger.read(str(out))
    fresh = {r["start"] for r in records if "start" in r and r["t"] > t}
    times = [r["t"] for r in records if "gen" in r and r["gen"] in fresh and r["t"] > t]
    return min(times) if times else None


def workers_on(cluster, host, script="train_torch.py"):
    """The processes running the job's script on ``host`` (a keeper's child, not the keeper), by PID.

    Horovod hands out ranks in an order of its own (a set's), so tests pick
    their victims by host, not by rank.
    """
    started = []
    for pid in cluster.processes(host):
        try:
            proc = psutil.Process(pid)
            if any(arg.endswith(script) for arg in proc.cmdline()) and \
                    proc.parent().cmdline() != proc.cmdline():  # the process Horovod started (maybe a keeper)
                started.append(launch.script_process(proc).pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(started)


def finish(job, timeout_s=WAIT_S * 2):
    code, output = job.wait(timeout_s)
    assert code == 0, f"the job failed ({code}):\n{output[-6000:]}"
    return output


def record(out, **figures):
    """Appends measured figures to ``out/figures.json`` and prints them (``pytest -s`` shows them)."""
    print(f"\nmultihost figures: {json.dumps(figures, sort_keys=True)}", flush=True)
    with open(out / "figures.json", "a") as handle:
        handle.write(json.dumps(figures, sort_keys=True) + "\n")


def assert_exactly_once_and_equal(out, epochs, phase):
    report = ledger.audit(ledger.read(str(out)), DIGITS, epochs)
    assert report["exactly_once"], f"{phase}: not exactly once: {report['epochs']}"
    finals = analysis.load_finals(str(out))
    assert finals, f"{phase}: no final state"
    analysis.assert_ranks_identical(finals)
    return report, finals

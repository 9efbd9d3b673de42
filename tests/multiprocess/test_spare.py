"""Under elastic-horovodrun a failed slot's new worker starts from the host's spare (elastic_ext/launch/spare.py).

Four workers of train_torch.py on two pseudo-hosts of this machine. Once the
host's spare (started by one of the job's first entries) listens, rank 3's
script process is SIGKILLed from outside. The survivors go on; the new worker
of the failed slot is the spare's: it finds PyTorch imported, writes the
``from_spare`` event naming its entry, joins, and the job ends as a job
without the spare would: every sample exactly once, the same final
parameters on every rank, exit status 0.
"""

import glob
import json
import os
import signal
import time

import psutil
import pytest

from elastic_ext.launch import spare
from elastic_ext.testing import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
EPOCHS = 8  # 28 steps of 0.1 s an epoch: the job outlasts its start, the spare's import and the regrowth
WORKER = os.path.join(launch.WORKERS, "train_torch.py")
WAIT_S = 180


def wait_for(job, what, condition):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        job.track_now_and_then()
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {what}:\n{open(job.log_path).read()[-5000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {WAIT_S} s:\n{open(job.log_path).read()[-5000:]}")
        time.sleep(0.05)


def spare_listening(job):
    """True once the spare of the job's host listens (its name comes from a worker's environment)."""
    for pid in job.members():
        try:
            env = psutil.Process(pid).environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        name = spare.address(WORKER, env)
        if name is None:
            continue
        with open("/proc/net/unix") as table:
            return any(len(f) >= 8 and f[7] == "@" + name[1:] and int(f[3], 16) & 0x10000
                       for f in (line.split() for line in table))
    return False


def script_of_rank(out, rank):
    """The pid of the process that writes rank ``rank``'s steps (the script's process)."""
    for path in glob.glob(str(out / "steps-*.jsonl")):
        with open(path) as f:
            starts = [json.loads(line) for line in f if '"start"' in line]
        if starts and starts[-1]["rank"] == rank:
            return int(os.path.basename(path)[len("steps-"):-len(".jsonl")])
    return None


@pytest.mark.timeout(300)
def test_a_failed_slots_new_worker_starts_from_the_hosts_spare(tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, ["localhost:2", "127.0.0.1:2"])
    cmd = launch.under_elastic_ext_driver(launch.elastic_cmd(
        4, 2, 4, hosts_file, "train_torch.py", "--out", str(out), "--epochs", str(EPOCHS), "--commit-every", "4",
        "--step-sleep-s", "0.1"))
    job = launch.Job(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl")),
                     str(out / "horovodrun.log"))
    try:
        wait_for(job, "rank 3 training", lambda: script_of_rank(out, 3) is not None)
        wait_for(job, "the host's spare listening", lambda: spare_listening(job))
        victim = script_of_rank(out, 3)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        code, output = job.wait(WAIT_S)
    finally:
        job.kill()
    assert code == 0, output[-5000:]
    events = analysis.read_events(str(out / "events.jsonl"))
    from_spare = [e for e in events if e["event"] == "from_spare"]
    assert len(from_spare) == 1, f"the failed slot's new worker did not start from the spare: {from_spare}"
    newcomer = from_spare[0]
    assert newcomer["time"] > killed_at and newcomer["entry_pid"] not in (victim, newcomer["pid"])
    assert 0 <= newcomer["handed_over_s"] < WAIT_S, newcomer
    records = ledger.read(str(out))
    assert analysis.sizes_by_generation(records) == [[4], [3], [4]]
    steps = out / f"steps-{newcomer['pid']}.jsonl"
    assert steps.exists() and '"start"' in steps.read_text(), "the spare's worker never trained"
    analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2, 3]
    analysis.assert_ranks_identical(finals)

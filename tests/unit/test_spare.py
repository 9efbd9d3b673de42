"""The host's spare (elastic_ext.launch.spare): a new worker's entry hands its slot to a process that imported torch.

Each test runs Horovod's own rendezvous server in this process (the spare's
job: it reads the driver's round from it, and exits when it stops
answering), a spare, and entries as elastic-horovodrun starts them
(``python -m elastic_ext.launch.worker SCRIPT``) in fresh interpreters.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import psutil
import pytest

from elastic_ext.launch import round_watch, spare
from elastic_ext.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 60

SCRIPT = """
import json, os, signal, sys, time
record = {"pid": os.getpid(), "torch_at_start": "torch" in sys.modules, "argv": sys.argv[1:],
          "cwd": os.getcwd(), "slot": os.environ.get("HOROVOD_LOCAL_RANK")}
import torch
from elastic_ext.launch import spare
record["served"] = spare.served
out = sys.argv[1]
with open(os.path.join(out, f"worker-{os.getpid()}.json"), "w") as f:
    json.dump(record, f)
print(f"worker {os.getpid()} says hello", flush=True)
print("worker error stream", file=sys.stderr, flush=True)
mode = sys.argv[2]
if mode == "exit":
    sys.exit(7)
if mode == "term":
    def leave(sig, frame):
        open(os.path.join(out, "terminated"), "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, leave)
open(os.path.join(out, "waiting"), "w").close()
while True:
    signal.pause()
"""


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def listening(name):
    """True when the abstract Unix socket ``name`` listens (its flags in /proc/net/unix say so)."""
    wanted = "@" + name[1:]
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == wanted and int(fields[3], 16) & 0x10000:
                return True
    return False


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def job(tmp_path):
    """Horovod's rendezvous server holding round 0, the environment of a worker of it, and a script."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init([])
    url = f"http://127.0.0.1:{port}/{round_watch.SCOPE}/{round_watch.CURRENT}"

    def set_round(number):
        request = urllib.request.Request(url, data=str(number).encode(), method="PUT")
        urllib.request.urlopen(request, timeout=5).close()

    set_round(0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ELASTIC_EXT_"))}
    env.update({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_LAUNCHER": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_LOCAL_RANK": "1", "PYTHONPATH": ROOT})
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    state = {"server": server, "env": env, "script": str(script), "out": tmp_path, "set_round": set_round,
             "stopped": False, "spares": []}
    yield state
    for proc in state["spares"]:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not state["stopped"]:
        server.stop()


def start_spare(job, *args):
    proc = subprocess.Popen([sys.executable, "-m", "elastic_ext.launch.worker", "--spare", *args, job["script"]],
                            env=job["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    job["spares"].append(proc)
    return proc


def entry(job, mode, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "elastic_ext.launch.worker", job["script"], str(job["out"]), mode],
                            env=job["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(job["out"]), **kwargs)


def records(job):
    import json
    return [json.loads(p.read_text()) for p in sorted(job["out"].glob("worker-*.json"))]


def spare_name(job):
    return spare.address(job["script"], job["env"])


def test_an_entry_hands_its_slot_to_the_spare_which_relays_output_and_exit_status(job):
    first = start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    proc = entry(job, "exit")
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 7, err
    [record] = records(job)
    assert record["torch_at_start"] is True, "the worker did not run in the spare: torch was not imported yet"
    assert record["pid"] != proc.pid
    assert record["argv"] == [str(job["out"]), "exit"] and record["cwd"] == str(job["out"]) and record["slot"] == "1"
    assert f"worker {record['pid']} says hello" in out, "the worker's stdout is not the entry's"
    assert record["served"]["entry_pid"] == proc.pid and 0 <= record["served"]["handed_over_s"] < DEADLINE_S
    assert "worker error stream" in err
    assert first.wait(timeout=DEADLINE_S) == 0, "the spare that took the slot did not end with its worker"


def test_the_spare_that_took_a_slot_starts_the_next_one_which_imports_torch_once_the_round_changed(job):
    start_spare(job)
    name = spare_name(job)
    wait_for(lambda: listening(name), "the first spare to listen")
    first = entry(job, "exit")
    first.communicate(timeout=DEADLINE_S)
    # The next spare holds the name but does not listen (nor import torch) while the round is the same.
    second = entry(job, "exit")
    second.communicate(timeout=DEADLINE_S)
    assert [r["torch_at_start"] for r in records(job)].count(False) == 1, "a second spare was ready too soon"
    assert not listening(name)
    job["set_round"](1)  # the worker that took the slot joined
    wait_for(lambda: listening(name), "the next spare to listen once the round changed")
    third = entry(job, "exit")
    third.communicate(timeout=DEADLINE_S)
    assert third.returncode == 7
    assert sorted(r["torch_at_start"] for r in records(job)) == [False, True, True]


def test_an_entry_that_finds_no_spare_runs_its_worker_itself_and_starts_one(job):
    proc = entry(job, "exit")
    out, err = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 7, err
    [record] = records(job)
    assert record["pid"] == proc.pid and record["torch_at_start"] is False and record["served"] is None
    wait_for(lambda: listening(spare_name(job)), "the spare the entry started to listen")
    started = [p for p in psutil.process_iter() if launch.spare_process(p)]
    assert started and all(p.ppid() != proc.pid for p in started), "the spare is not detached from its entry"


def test_a_worker_killed_ends_its_entry_with_the_same_signal(job):
    start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    proc = entry(job, "wait")
    wait_for(lambda: (job["out"] / "waiting").exists(), "the worker to start")
    [record] = records(job)
    # Tools find the worker from the entry Horovod's driver started: it is named after the worker.
    entry_process = psutil.Process(proc.pid)
    assert spare.relayed_worker(entry_process.name()) == record["pid"], entry_process.name()
    assert launch.script_process(entry_process).pid == record["pid"]
    os.kill(record["pid"], signal.SIGKILL)
    proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == -signal.SIGKILL


def test_with_a_keeper_the_entry_learns_the_end_from_the_keeper_not_from_the_spare(job):
    # Restart in place: the spare's worker is a keeper and the script runs in its child. The keeper
    # tells the entry of the child's end itself, before its own exit (the spare is stopped here).
    job["env"]["ELASTIC_EXT_RESTART_IN_PLACE"] = "1"
    relay = start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    proc = entry(job, "wait")
    wait_for(lambda: (job["out"] / "waiting").exists(), "the worker to start")
    [record] = records(job)
    keeper_process = psutil.Process(record["pid"]).parent()
    assert keeper_process.pid == spare.relayed_worker(psutil.Process(proc.pid).name())
    assert launch.script_process(psutil.Process(proc.pid)).pid == record["pid"]
    os.kill(relay.pid, signal.SIGSTOP)
    try:
        os.kill(record["pid"], signal.SIGKILL)
        proc.communicate(timeout=DEADLINE_S)
    finally:
        os.kill(relay.pid, signal.SIGCONT)
    assert proc.returncode == -signal.SIGKILL


def test_sigterm_to_the_entry_reaches_the_worker(job):
    start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    proc = entry(job, "term")
    wait_for(lambda: (job["out"] / "waiting").exists(), "the worker to start")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=DEADLINE_S)
    assert (job["out"] / "terminated").exists(), "the worker never saw the SIGTERM sent to its entry"
    assert proc.returncode == 143


def test_the_worker_dies_with_its_entry(job):
    start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    proc = entry(job, "wait")
    wait_for(lambda: (job["out"] / "waiting").exists(), "the worker to start")
    [record] = records(job)
    proc.kill()
    proc.communicate(timeout=DEADLINE_S)
    wait_for(lambda: not alive(record["pid"]), "the worker to die with its entry")


def test_a_spare_exits_when_its_job_is_gone(job):
    proc = start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the spare to listen")
    job["server"].stop()
    job["server"]._httpd.server_close()  # the driver's process is gone: connections are refused
    job["stopped"] = True
    assert proc.wait(timeout=DEADLINE_S) == 0


def test_a_busy_driver_missing_a_read_is_not_a_job_gone(monkeypatch):
    import urllib.error

    answers = []

    def read(key, environ=None):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(round_watch, "read", read)
    job = spare._Job()
    answers.extend([TimeoutError("timed out")] * (spare.MISSES_BEFORE_GONE - 1) + [b"3"])
    for _ in range(spare.MISSES_BEFORE_GONE - 1):
        assert job.current_round() is None and not job.gone
    assert job.current_round() == b"3" and job.misses == 0, "an answer starts the count again"
    answers.extend([TimeoutError("timed out")] * spare.MISSES_BEFORE_GONE)
    for _ in range(spare.MISSES_BEFORE_GONE):
        job.current_round()
    assert job.gone, f"{spare.MISSES_BEFORE_GONE} reads in a row without an answer"
    refused = spare._Job()
    answers.append(urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")))
    refused.current_round()
    assert refused.gone, "a refused connection means the driver is gone"


def test_a_second_spare_for_the_same_job_exits_at_once(job):
    first = start_spare(job)
    wait_for(lambda: listening(spare_name(job)), "the first spare to listen")
    second = start_spare(job)
    assert second.wait(timeout=DEADLINE_S) == 0
    assert first.poll() is None


def test_no_spare_outside_a_launcher_worker_or_for_a_script_without_torch(job, tmp_path):
    env = job["env"]
    assert spare.address(job["script"], env) is not None
    assert spare.address(job["script"], {k: v for k, v in env.items() if k != "ELASTIC_EXT_LAUNCHER"}) is None
    assert spare.address(job["script"], {**env, "ELASTIC_EXT_RESTARTED_IN_PLACE": "0"}) is None
    assert spare.address(None, env) is None
    plain = tmp_path / "plain.py"
    plain.write_text("import numpy\n")
    assert spare.address(str(plain), env) is None


def test_only_the_same_user_may_hand_over_a_slot():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert spare._same_user(a) is True
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("source, expected", [
    ("import torch\n", True),
    ("import numpy as np, torch.nn as nn\n", True),
    ("import horovod.torch as hvd\n", True),
    ("from elastic_ext.torch import ElasticSampler\n", True),
    ("def f():\n    import torch\n", True),
    ("import tensorflow as tf\nimport horovod.tensorflow as hvd\n", False),
    ("import torchvision_like\nfrom . import torch\n", False),  # another name; a relative import
    ("# import torch\ntext = 'import torch'\n", False),
    ("import torch(\n", False),  # not Python: the script's own run reports it
])
def test_which_scripts_import_torch(tmp_path, source, expected):
    path = tmp_path / "script.py"
    path.write_text(source)
    assert spare.imports_torch(str(path)) is expected


def test_script_path_of_a_module_is_found_only_for_a_top_level_module(tmp_path, monkeypatch):
    (tmp_path / "train_mod.py").write_text("import torch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert spare.script_path("train_mod", module=True) == str(tmp_path / "train_mod.py")
    assert spare.script_path("elastic_ext.launch.worker", module=True) is None  # would import its package
    assert spare.script_path("no_such_module_here", module=True) is None
    assert spare.script_path("train.py", module=False) == "train.py"
    assert spare.imports_torch(str(tmp_path / "missing.py")) is False

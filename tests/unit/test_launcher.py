"""elastic-horovodrun starts each worker's Python through elastic_ext.worker.entry, which then runs the script."""

import json
import os
import subprocess
import sys
import time

import pytest

from elastic_ext.launch import build_check
from elastic_ext.launch.command_line import WORKER_MODULE, worker_command
from devkit.launch import Job, base_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("command, expected", [
    (["python", "train.py", "--epochs", "2"], ["python", "-m", WORKER_MODULE, "train.py", "--epochs", "2"]),
    (["/venv/bin/python3.11", "-u", "-X", "dev", "train.py"],
     ["/venv/bin/python3.11", "-u", "-X", "dev", "-m", WORKER_MODULE, "train.py"]),
    (["python", "-m", "pkg.train", "--lr", "1"], ["python", "-m", WORKER_MODULE, "-m", "pkg.train", "--lr", "1"]),
])
def test_a_python_worker_starts_through_the_entry_module(command, expected):
    assert worker_command(command) == expected
    assert worker_command(expected) == expected  # never twice


@pytest.mark.parametrize("command", [["bash", "run.sh"], ["python", "-c", "print(1)"], ["python"], [],
                                     ["python", "--version"]])
def test_other_commands_run_as_given(command):
    assert worker_command(command) == command


def test_the_entry_runs_a_script_as_python_would(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 41\n")
    (tmp_path / "train.py").write_text(
        "import sys, helper\n"
        "print(__name__, sys.argv, helper.VALUE + 1, sys.path[0] == sys.argv[0].rsplit('/', 1)[0])\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", WORKER_MODULE, str(tmp_path / "train.py"), "--epochs", "2"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"__main__ {[str(tmp_path / 'train.py'), '--epochs', '2']} 42 True"


def test_the_entry_runs_a_module_and_says_how_to_call_it(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nsys.exit(3)\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", WORKER_MODULE, "-m", "pkg.train", "x"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (3, "__main__ ['x']"), done.stderr
    bare = subprocess.run([sys.executable, "-m", WORKER_MODULE], env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "usage: python -m elastic_ext.worker.entry" in bare.stderr


@pytest.mark.parametrize("given, seen", [(None, "1"), ("0", "0")])
def test_the_entry_has_pytorch_put_large_tensors_in_huge_pages_unless_told_otherwise(tmp_path, given, seen):
    (tmp_path / "train.py").write_text(
        "import os, sys\n"
        "print('torch' in sys.modules, os.environ.get('THP_MEM_ALLOC_ENABLE'))\n")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = REPO
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    done = subprocess.run([sys.executable, "-m", WORKER_MODULE, str(tmp_path / "train.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # set before the script runs and before PyTorch is imported: its allocator reads it at its first allocation
    assert done.stdout.split() == ["False", seen]


@pytest.mark.parametrize("runner", ["script", "cached checks"])
def test_a_test_jobs_horovodrun_line_moves_to_the_launcher_and_takes_options_with_its_arguments(runner, monkeypatch):
    from devkit import launch
    monkeypatch.setattr(launch, "RUNNER", launch.HOROVODRUN_SCRIPT if runner == "script" else launch.CACHED_CHECKS)
    cmd = launch.elastic_cmd(4, 2, 4, "/tmp/hosts", "train.py", "--epochs", "1")
    args = launch.horovodrun_args(cmd)
    assert cmd == [*launch.RUNNER, *args] and args[:2] == ["-np", "4"], cmd
    assert launch.under_elastic_ext_driver(cmd) == [sys.executable, "-m", "elastic_ext.launch.horovodrun", *args]
    assert launch.with_options(cmd, ["--verbose"]) == [*launch.RUNNER, "--verbose", *args]


def test_plain_horovodrun_with_cached_checks_is_horovods_runner(tmp_path):
    # A Gloo job of two ranks: Horovod's runner sets each rank's environment and prefixes its output
    # with the rank; its Gloo build check is answered through the launcher's cache, which then holds it.
    script = ("import os; print('env', *(os.environ[k] for k in "
              "('HOROVOD_RANK', 'HOROVOD_SIZE', 'HOROVOD_CONTROLLER')))")
    result = subprocess.run([sys.executable, "-m", "elastic_ext.launch.plain_horovodrun", "-np", "2", "-H",
                             "localhost:2", "--gloo", "--network-interfaces", "lo", sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted(line for line in result.stdout.splitlines() if ":env " in line)
    assert lines == ["[0]<stdout>:env 0 2 gloo", "[1]<stdout>:env 1 2 gloo"], result.stdout
    with open(build_check.cache_path()) as handle:
        cache = json.load(handle)
    assert cache["gloo_built"]["value"] is True, cache


def test_importing_plain_horovodrun_imports_neither_horovod_nor_the_launchers_changes():
    # Horovod's runner starts every command (each discovery run, each worker) through a "spawn"
    # multiprocessing child, which imports the parent's main module: it must stay this small.
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import elastic_ext.launch.plain_horovodrun"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "elastic_ext.launch.plain_horovodrun" in imported, done.stderr[-2000:]
    assert not {m for m in imported if m == "horovod" or m.startswith(("horovod.", "elastic_ext.launch.horovod"))}


def test_a_job_that_times_out_says_where_each_of_its_python_processes_waits(tmp_path):
    # A job test that gives up prints every process's stack (Job.stacks, through py-spy): a process
    # waiting in a function of its own must show that function, the wait it is in and the C call under it.
    ready = tmp_path / "ready"
    script = ("import sys, threading\n"
              "def waiting_here():\n"
              "    open(sys.argv[1], 'w').close()\n"
              "    threading.Event().wait()\n"
              "waiting_here()\n")
    job = Job([sys.executable, "-c", script, str(ready)], base_env(), str(tmp_path / "job.log"))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert job.proc.poll() is None and time.monotonic() < deadline, open(job.log_path).read()
        time.sleep(0.01)
    with pytest.raises(AssertionError) as raised:
        job.wait(0.5)  # the script never ends: the job times out
    message = str(raised.value)
    assert "job timed out after 0.5s" in message and "stacks before the kill" in message, message
    assert "waiting_here" in message and "Event.wait" in message, message
    assert "(libc.so" in message, f"no native frame (the C call the wait blocks in): {message}"

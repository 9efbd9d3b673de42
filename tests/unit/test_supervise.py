"""python -m elastic_ext.launch.supervise: restarts a failed job, within a limit, and says so."""

import json
import subprocess
import sys

import pytest

from elastic_ext.launch import supervise


def job(tmp_path, fail_times):
    """A command that fails (exit 3) the first fail_times runs, then succeeds; counts its runs."""
    counter = tmp_path / "runs"
    script = (f"import pathlib,sys; p=pathlib.Path({str(counter)!r}); n=int(p.read_text()) if p.exists() else 0; "
              f"p.write_text(str(n+1)); sys.exit(3 if n < {fail_times} else 0)")
    return [sys.executable, "-c", script], counter


def test_a_failed_job_is_restarted_until_it_succeeds(tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("ELASTIC_EXT_EVENTS_PATH", str(events))
    command, counter = job(tmp_path, 2)
    lines = []
    assert supervise.supervise(command, max_restarts=3, backoff_s=0, log=lines.append) == 0
    assert counter.read_text() == "3"
    restarts = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e["exit_code"], e["restart"]) for e in restarts] == [("job_restart", 3, 1),
                                                                              ("job_restart", 3, 2)]
    assert "restart 1 of 3" in lines[0]


def test_the_limit_ends_it_with_the_jobs_exit_code(tmp_path):
    command, counter = job(tmp_path, 10)
    lines = []
    assert supervise.supervise(command, max_restarts=1, backoff_s=0, log=lines.append) == 3
    assert counter.read_text() == "2"
    assert "giving up" in lines[-1]


def test_bad_arguments_and_a_missing_checkpoint_dir_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTIC_EXT_CHECKPOINT_DIR", raising=False)
    run = lambda *args: subprocess.run([sys.executable, "-m", "elastic_ext.launch.supervise", *args],
                                       capture_output=True, text=True)
    result = run("--", "true")
    assert result.returncode == 2 and "ELASTIC_EXT_CHECKPOINT_DIR is not set" in result.stderr
    result = run("--max-restarts", "-1", "--allow-no-checkpoint", "--", "true")
    assert result.returncode == 2 and "--max-restarts (-1) must be >= 0" in result.stderr
    assert run("--allow-no-checkpoint", "--", "true").returncode == 0
    with pytest.raises(SystemExit):
        supervise.main(["--allow-no-checkpoint"])


def test_the_job_is_told_which_restart_it_is(tmp_path):
    seen = tmp_path / "seen"
    script = (f"import os; open({str(seen)!r}, 'a').write(os.environ['ELASTIC_EXT_RESTART'] + ','); "
              f"raise SystemExit(0 if os.path.getsize({str(seen)!r}) > 2 else 1)")
    assert supervise.supervise([sys.executable, "-c", script], max_restarts=2, backoff_s=0, log=lambda _: None) == 0
    assert seen.read_text() == "0,1,"


def test_the_ledger_reads_a_restarted_job_after_the_dead_one(tmp_path):
    from devkit import ledger

    def lines(name, records):
        with open(tmp_path / f"steps-{name}.jsonl", "w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")

    def step(gen, cursor, **extra):
        return {"gen": gen, "epoch": 0, "cursor": cursor, "step": cursor, "rank": 0, "size": 1,
                "indices": [cursor], "pads": 0, "t": float(cursor), **extra}

    # The dead job: generation 1 from 0 (commits at 2 and 4, only 2 durable), then
    # generation 2 from its commit at 4; the restart resumes from the checkpoint at
    # 2 and numbers its generation 2 again.
    lines(1, [{"start": 1, "epoch": 0, "cursor": 0, "step": 0, "rank": 0, "size": 1, "t": 0.0}]
          + [step(1, c) for c in range(5)]
          + [{"start": 2, "epoch": 0, "cursor": 4, "step": 4, "rank": 0, "size": 1, "t": 5.0}, step(2, 4)])
    lines(2, [{"start": 2, "epoch": 0, "cursor": 2, "step": 2, "rank": 0, "size": 1, "t": 9.0, "restart": 1}]
          + [step(2, c, restart=1) for c in range(2, 6)])
    report = ledger.audit(ledger.read(str(tmp_path)), dataset_size=6, epochs=1)
    assert report["exactly_once"], report
    assert report["lost_steps"] == 4  # cursors 2, 3, 4 of the dead generation 1 and 4 of its generation 2


def test_a_blank_checkpoint_dir_is_not_a_checkpoint_dir(monkeypatch):
    """Audit L3: before, "  " passed supervise's check while the workers read it as unset (checkpoints off)."""
    monkeypatch.setenv("ELASTIC_EXT_CHECKPOINT_DIR", "  ")
    result = subprocess.run([sys.executable, "-m", "elastic_ext.launch.supervise", "--max-restarts", "1", "--",
                             "true"], capture_output=True, text=True)
    assert result.returncode == 2 and "ELASTIC_EXT_CHECKPOINT_DIR is not set (it is '  ')" in result.stderr


def test_sighup_is_passed_on_to_the_job_and_stops_the_restarts(tmp_path):
    """Audit L3: before, a SIGHUP (the terminal closed) killed the supervisor and left its job running."""
    import os
    import signal
    import threading
    import time
    ready, got = tmp_path / "ready", tmp_path / "got-hup"
    script = (f"import pathlib, signal, sys, time\n"
              f"signal.signal(signal.SIGHUP, lambda *a: (pathlib.Path({str(got)!r}).touch(), sys.exit(7)))\n"
              f"pathlib.Path({str(ready)!r}).touch()\n"
              f"time.sleep(120)\nsys.exit(3)\n")

    def hang_up():
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polls for the child's ready file, bounded
        os.kill(os.getpid(), signal.SIGHUP)

    before = signal.getsignal(signal.SIGHUP)
    sender = threading.Thread(target=hang_up)
    sender.start()
    code = supervise.supervise([sys.executable, "-c", script], max_restarts=3, backoff_s=0, log=lambda _: None)
    sender.join()
    assert code == 7 and got.exists()
    assert signal.getsignal(signal.SIGHUP) == before, "the supervisor's handler is removed afterwards"

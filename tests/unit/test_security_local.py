"""Hostile inputs from the security audit (issue 53), local findings: each test feeds one and asserts the outcome.

- H2: an events file that cannot be written (``/dev/full``) never breaks the
  checkpoint writer's failure count; ``read_events`` skips a torn last line (L6).
- H3: the fence exits whatever its event write does (raises, blocks).

The checkpoint directory (H4, L1, M3, M4), metadata (M1, L2) and the
supervisor (L3) have their own files: ``test_checkpoint_lock.py``,
``test_checkpoint_retention.py``, ``test_metadata_hostile.py``, ``test_supervise.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import elastic_ext
from elastic_ext.config import ElasticConfig
from elastic_ext.events import CHECKPOINT_FAILED, EventLog, read_events
from elastic_ext import exit_codes
from elastic_ext.runtime.driver_watch import FENCE_MIN_ATTEMPTS, FENCE_S, DriverWatch
from elastic_ext.testing import SoloBinding, state_on

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEV_FULL = "/dev/full"


# ------------------------------------------------------------------ H2: events never fail the job

def test_an_event_log_on_a_full_disk_never_raises_and_keeps_its_history(caplog):
    events = EventLog(DEV_FULL, lambda: 0, lambda: 1)
    for _ in range(3):
        events.emit(CHECKPOINT_FAILED, commit_id=1)
    assert [e["event"] for e in events.history] == [CHECKPOINT_FAILED] * 3
    errors = [r for r in caplog.records if "cannot write events" in r.getMessage()]
    assert len(errors) == 1 and DEV_FULL in errors[0].getMessage(), "logged once, naming the file"


def test_checkpoint_failure_limit_fires_at_its_count_when_events_cannot_be_written(tmp_path):
    """Before: the first failed write raised TypeError in commit(), and failures were never counted."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = ElasticConfig(checkpoint_dir=str(blocker / "ckpt"), checkpoint_failure_limit=2, checkpoint_every=1,
                           events_path=DEV_FULL, hang_timeout_s=0)
    state = state_on(SoloBinding(), config=config, weights=np.zeros(4), step=0)
    for _ in range(2):
        state.step += 1
        state.commit()
        state.wait_for_checkpoint()
    assert state._checkpointer.failures_in_a_row == 2
    assert str(blocker) in state._checkpointer.failing()
    with pytest.raises(elastic_ext.CheckpointError, match="2 writes in a row"):
        state.step += 1
        state.commit()


def test_read_events_skips_a_torn_last_line_but_not_damage_inside(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "sync"}) + "\n" + '{"event": "rollb')
    assert read_events(str(path)) == [{"event": "sync"}]
    path.write_text('{"event": "rollb\n' + json.dumps({"event": "sync"}) + "\n")
    with pytest.raises(ValueError):
        read_events(str(path))


def test_the_events_file_is_created_private(tmp_path):
    EventLog(str(tmp_path / "events.jsonl"), lambda: 0, lambda: 1).emit("sync")
    assert os.stat(tmp_path / "events.jsonl").st_mode & 0o777 == 0o600


# ------------------------------------------------------------------ H3: the fence exits first

class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _closed_port_url():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/elastic_ext_round"


def _drive_to_the_fence(watch, clock):
    for _ in range(FENCE_MIN_ATTEMPTS + 2):
        watch.check()
        clock.now += FENCE_S


class _RaisingEvents:
    def emit(self, event, **fields):
        raise OSError(28, "No space left on device")


def test_the_fence_exits_when_its_event_write_raises():
    exits, clock = [], _Clock()
    watch = DriverWatch(_closed_port_url(), lambda reason: 0, _RaisingEvents(), exit_fn=exits.append, clock=clock)
    _drive_to_the_fence(watch, clock)
    assert exits and set(exits) == {exit_codes.FENCED}


# The fence in a process of its own: os._exit must really end it, whatever the events file does.
_FENCED_WORKER = textwrap.dedent("""
    import sys
    from elastic_ext.events import EventLog
    from elastic_ext.runtime.driver_watch import FENCE_MIN_ATTEMPTS, FENCE_S, DriverWatch
    clock = [1000.0]
    watch = DriverWatch(sys.argv[1], lambda reason: 0, EventLog(sys.argv[2], lambda: 0, lambda: 1),
                        clock=lambda: clock[0])
    for _ in range(FENCE_MIN_ATTEMPTS + 2):
        watch.check()
        clock[0] += FENCE_S
    print("STILL TRAINING", flush=True)
    sys.exit(0)
""")


def _fenced_worker(events_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", _FENCED_WORKER, _closed_port_url(), events_path], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_fenced_worker_exits_with_its_events_on_a_full_disk():
    done = _fenced_worker(DEV_FULL)
    assert done.returncode == exit_codes.FENCED, done.stdout + done.stderr
    assert "STILL TRAINING" not in done.stdout


def test_a_fenced_worker_exits_when_its_event_write_blocks(tmp_path):
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)  # nobody reads it: opening it for writing blocks for ever
    done = _fenced_worker(str(fifo))
    assert done.returncode == exit_codes.FENCED, done.stdout + done.stderr
    assert "STILL TRAINING" not in done.stdout

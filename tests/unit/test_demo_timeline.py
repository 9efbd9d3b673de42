"""The demo's timeline marks numeric rollbacks and straggler evictions, once each."""

import importlib.util
import os

from devkit import launch

spec = importlib.util.spec_from_file_location("run_demo", os.path.join(launch.REPO, "examples", "run_demo.py"))
run_demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_demo)


def test_soft_failures_keep_the_first_copy_of_each_and_are_drawn(tmp_path):
    events = [{"event": "sync", "time": 1.0, "rank": r} for r in range(2)]
    events += [{"event": "numeric_rollback", "commit_id": 3, "step": 14, "time": 5.0 + r, "rank": r} for r in range(2)]
    events += [{"event": "straggler", "commit_id": 7, "step": 28, "time": 9.0 + r, "rank": r} for r in range(2)]
    soft = run_demo.soft_failures(events)
    assert [(e["event"], e["time"]) for e in soft] == [("numeric_rollback", 5.0), ("straggler", 9.0)]
    records = [{"gen": 1, "rank": 0, "step": s, "size": 2, "t": float(s)} for s in range(20)]
    path = run_demo.plot_timeline(str(tmp_path / "t.png"), records, [], 0.0, None, soft)
    assert os.path.getsize(path) > 1000


def scale_up_events(joined):
    """A 4-worker job that grows to 6 by an early start at commit 37, resized at commit 59, the last."""
    events = [{"event": "sync", "time": 0.0, "rank": 0, "size": 4},
              {"event": "prestart", "commit_id": 37, "time": 10.0, "rank": 0, "size": 4}]
    if joined:
        events.append({"event": "newcomers_joined", "commit_id": 59, "time": 17.9, "rank": 0, "why": "all_there"})
    events += [{"event": "resize", "commit_id": 59, "time": 18.0, "rank": 0, "size": 4},
               {"event": "recovered", "generation": 4, "size": 6, "time": 24.0, "rank": 0},
               {"event": "finish", "commit_id": 59, "time": 24.1, "rank": 0, "size": 6}]
    return events


def test_a_scale_up_at_the_end_of_training_says_the_survivors_waited_for_the_newcomers():
    [incident] = run_demo.incidents(scale_up_events(joined=False), [], None)
    text = run_demo.describe(incident, 0.0)
    assert "training ended (commit 59) before they were ready: survivors idle 6.0s until the newcomers joined" in text
    assert "received the state" not in text


def test_a_scale_up_whose_newcomers_were_ready_says_they_received_the_state():
    [incident] = run_demo.incidents(scale_up_events(joined=True), [], None)
    text = run_demo.describe(incident, 0.0)
    assert "resized at commit 59: survivors idle 6.0s while the newcomers received the state" in text
    assert "training ended" not in text

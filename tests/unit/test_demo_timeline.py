"""The demo's timeline marks numeric rollbacks and straggler evictions, once each."""

import importlib.util
import os

from elastic_ext.testing import launch

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

"""The README's main job, run exactly as the README says: ``.venv/bin/python examples/run_demo.py``.

It must exit 0 and its summary must show what the demo is for: a worker
killed and the survivors back to training at once, the failed slot's new
worker and an added host's workers taken in while the survivors kept
training (early starts, the default under the launcher), every sample
exactly once, and a timeline picture. The test re-reads the demo's own
ledger and event files instead of trusting its printed verdict alone.
"""

import os
import re
import shutil
import sys

import pytest

from elastic_ext.events import read_events
from devkit import ledger
from tests.multiprocess import launch

USER_DEFAULTS = True  # what users run: the guardian on, as by default (see tests/conftest.py)
DEMO = os.path.join(launch.REPO, "examples", "run_demo.py")


@pytest.mark.timeout(480)
def test_readme_main_job(tmp_path):
    # The README's command line: the venv's interpreter, the script, no arguments, from the repo root.
    code, output = launch.run([sys.executable, DEMO], dict(os.environ), str(tmp_path / "demo.log"), timeout_s=450)
    logs = re.search(r"^logs: (.+)$", output, re.MULTILINE)
    assert logs, f"the demo printed no 'logs:' line; output tail:\n{output[-4000:]}"
    work = logs.group(1).strip()
    try:
        assert code == 0, f"demo exited {code}; output tail:\n{output[-4000:]}"
        assert "verdict: OK" in output, output[-4000:]
        assert re.search(r"exactly once: True \(duplicated 0, missing 0\)", output), output[-4000:]
        failure = re.search(r"failure: rank 3 was SIGKILLed at step (\d+);.*?(\d+) steps rolled back.*?"
                            r"back to training on (\d+) workers ([0-9.]+)s after the failure was seen", output, re.S)
        assert failure, f"no failure-and-recovery line in the summary:\n{output[-4000:]}"
        # Under elastic-horovodrun the survivors go on at once, the killed worker's host mate with them.
        assert int(failure.group(3)) == 3, failure.group(0)
        scale_ups = re.findall(r"scale-up to (\d+) workers \((\d+) newcomers?([^)]*)\): the survivors kept training "
                               r"for ([0-9.]+)s.*?survivors idle ([0-9.]+)s", output, re.S)
        assert scale_ups, f"no scale-up line in the summary:\n{output[-4000:]}"
        assert int(scale_ups[-1][0]) == 6, scale_ups
        assert any("host added" in s[2] for s in scale_ups), f"no scale-up took in the added host: {scale_ups}"
        # The added host has 2 slots: the scale-up named for it takes in both of its workers.
        assert all(int(s[1]) >= 2 for s in scale_ups if "host added" in s[2]), (
            f"the added host is named for a scale-up of fewer newcomers than its 2 slots: {scale_ups}")

        picture = re.search(r"^timeline picture: (.+)$", output, re.MULTILINE).group(1).strip()
        with open(picture, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n", f"{picture} is not a PNG"

        # The demo's verdict, checked against its own files.
        records = ledger.read(os.path.join(work, "ledger"))
        report = ledger.audit(records, dataset_size=1500, epochs=10)
        assert report["exactly_once"], report["epochs"]
        assert [e["processed"] for e in report["epochs"]] == [1500] * 10
        sizes = [r["size"] for r in sorted((r for r in records if "gen" in r), key=lambda r: r["t"])]
        assert sizes[0] == 4, f"world sizes seen: {sorted(set(sizes))}"

        # Every scale-up with the defaults: the survivors trained while the newcomers started (the failed
        # slot's new worker and the added host's, in one early start or two, as their start times fall).
        events = sorted(read_events(os.path.join(work, "events.jsonl")), key=lambda e: e["time"])
        early = [e for e in events if e["event"] == "prestart" and e["rank"] == 0]
        assert early, "no early start"
        for start in early:
            # The resize that takes the newcomers in: at the commit that agrees they are all there, or at the
            # last commit when their start outlasted training (a cold clone on two cores).
            resize = [e for e in events if e["event"] == "resize" and e["rank"] == 0 and e["time"] > start["time"]]
            assert resize and resize[0]["commit_id"] > start["commit_id"], (start, resize)
            trained = [r for r in records
                       if "gen" in r and r["rank"] == 0 and start["time"] < r["t"] < resize[0]["time"]]
            # An early start at the last commit of training has no step left to train beside it.
            later = [r for r in records if "gen" in r and r["rank"] == 0 and r["t"] > start["time"]]
            assert trained or not later, (
                f"no step was trained between the early start at {start} and the resize {resize[0]}")
        assert [e for e in events if e["event"] == "recovered" and e["size"] == 6], "the job never ran on 6 workers"
    finally:
        shutil.rmtree(work, ignore_errors=True)

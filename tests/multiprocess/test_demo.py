"""The README's main job, run exactly as the README says: ``.venv/bin/python examples/run_demo.py``.

It must exit 0 and its summary must show what the demo is for: a worker
killed and the job recovered, a host added and the job grown while the
survivors kept training (the newcomers started early, the default under the
launcher), every sample exactly once, and a timeline picture. The test re-reads the demo's own
ledger and event files instead of trusting its printed verdict alone.
"""

import os
import re
import shutil
import sys

import pytest

from elastic_ext.events import read_events
from elastic_ext.testing import ledger
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
        # Under elastic-horovodrun the killed worker's host mate stays and its slot gets a new worker.
        assert int(failure.group(3)) == 4, failure.group(0)
        scale_up = re.search(r"scale-up: a host was added; the survivors kept training for ([0-9.]+)s.*?"
                             r"back to training on (\d+) workers ([0-9.]+)s after the host was added", output, re.S)
        assert scale_up, f"no scale-up line in the summary:\n{output[-4000:]}"
        assert int(scale_up.group(2)) > 2, scale_up.group(0)
        assert "after the failure was seen" not in scale_up.group(0)

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

        # The scale-up with the defaults: the survivors trained while the newcomers started.
        assert re.search(r"survivors idle [0-9.]+s", scale_up.group(0)), scale_up.group(0)
        events = sorted(read_events(os.path.join(work, "events.jsonl")), key=lambda e: e["time"])
        early = [e for e in events if e["event"] == "prestart" and e["rank"] == 0]
        assert len(early) == 1, early
        # The resize that takes the newcomers in: at the commit that agrees they are all there, or at the
        # last commit when their start outlasted training (a cold clone on two cores).
        resize = [e for e in events if e["event"] == "resize" and e["rank"] == 0 and e["time"] > early[0]["time"]]
        assert resize and resize[0]["commit_id"] > early[0]["commit_id"], (early, resize)
        # The job grew to 6.
        assert [e for e in events if e["event"] == "recovered" and e["size"] == 6], "the job never ran on 6 workers"
        trained = [r for r in records
                   if "gen" in r and r["rank"] == 0 and early[0]["time"] < r["t"] < resize[0]["time"]]
        assert trained, "no step was trained between the early start of the newcomers and the resize that took them in"
    finally:
        shutil.rmtree(work, ignore_errors=True)

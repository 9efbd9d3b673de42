"""bench.recovery end to end, one failure: the job ends, and the recovery it reports is the failure's.

Under ``elastic-horovodrun`` the killed slot's new worker starts at the
survivors' sync, so it is on its way when they finish and ``@elastic_ext.run``
takes it in, then calls the training function again on every rank from the
commit of the end. The benchmark's worker once decided its end from a local
variable and trained on at 4 workers until the benchmark's timeout; and its
analysis then took the newcomer's later ``recovered`` event for the failure's.
"""

import glob
import json
import os
import sys

import pytest

from elastic_ext.events import read_events
from tests.multiprocess import launch

USER_DEFAULTS = True  # what users run: the guardian on, as by default (see tests/conftest.py)


@pytest.mark.timeout(300)
def test_one_failure_ends_with_the_new_worker_taken_in_and_reports_the_failure_s_recovery(tmp_path):
    name = str(tmp_path / "recovery")
    code, output = launch.run([sys.executable, "-m", "bench.recovery", "--systems", "ext", "--models", "mlp",
                               "--failures", "1", "--name", name], launch.base_env(),
                              str(tmp_path / "bench.log"), timeout_s=280)
    assert code == 0, output[-5000:]
    with open(name + ".json", encoding="utf-8") as handle:
        saved = json.load(handle)
    (series,) = saved["results"]
    assert series["recovered"] == 1 and series["exit_codes"] == [0], {k: series[k] for k in ("recovered", "exit_codes")}
    missing = [part for part, values in series["breakdown"].items() if values[0] is None]
    assert not missing, f"breakdown parts not measured: {missing}"
    # The failure's recovered event comes before the survivors' first step after the kill.
    assert series["breakdown"]["first_step_s"][0] >= 0, series["breakdown"]
    assert series["first_step_s"][0] >= 0, series
    (events_path,) = glob.glob(os.path.join(saved["work_dir"], "*", "events.jsonl"))
    events = read_events(events_path)
    finishes = sorted((e["rank"], e["size"]) for e in events if e["event"] == "finish")
    assert finishes == [(rank, 4) for rank in range(4)], f"the job should end with the new worker in: {finishes}"

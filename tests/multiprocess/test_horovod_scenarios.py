"""Horovod's elastic integration scenarios (its test/integration/elastic_common.py),
for a job that uses elastic_ext's State and run: our own tests of the same
situations, with a PyTorch loop and a TF2 loop (Keras 3 model,
elastic_ext's DistributedGradientTape).

Covered: hosts added then removed (discovery follows the epochs rank 0
finished), a single rank failing (by exception and by SIGKILL) on two hosts,
and every rank failing. Each successful job also trains every sample exactly
once per epoch in its committed history.
"""

import json
import os
import sys

import pytest

from elastic_ext.testing import ledger
from tests.multiprocess import launch

DISCOVERY = os.path.join(launch.WORKERS, "schedule_discovery.py")
BATCHES, GLOBAL_BATCH = 6, 32


def run_scenario(tmp_path, flavour, schedule, *extra, np_=2, min_np=2, max_np=4, timeout_s=300):
    logfile = str(tmp_path / "epochs.jsonl")
    out = tmp_path / "ledger"
    cmd = [os.path.join(launch.VENV_BIN, "horovodrun"), "-np", str(np_), "--min-np", str(min_np),
           "--max-np", str(max_np), "--host-discovery-script",
           f"{DISCOVERY} {logfile} '{json.dumps(schedule)}'", "--network-interfaces", "lo",
           sys.executable, os.path.join(launch.WORKERS, "scenario_train.py"), "--flavour", flavour,
           "--logfile", logfile, "--out", str(out), "--batches", str(BATCHES), *extra]
    code, output = launch.run(cmd, launch.base_env(), str(tmp_path / "horovodrun.log"), timeout_s)
    epochs = []
    if os.path.exists(logfile):
        with open(logfile) as handle:
            epochs = [json.loads(line) for line in handle if line.strip()]
    return code, output, epochs, out


def assert_exactly_once(out, epochs):
    report = ledger.audit(ledger.read(str(out)), BATCHES * GLOBAL_BATCH, epochs)
    assert report["exactly_once"], report["epochs"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour", ["torch", "tf"])
def test_hosts_added_and_removed(tmp_path, flavour):
    schedule = [[0, ["localhost:2"]], [1, ["localhost:2", "127.0.0.1:2"]], [None, ["127.0.0.1:2"]]]
    code, output, epochs, out = run_scenario(tmp_path, flavour, schedule, "--epoch-wait-s", "3")
    assert code == 0, output[-5000:]
    assert [e["size"] for e in epochs] == [2, 4, 2], epochs
    assert [e["hostname"] for e in epochs] == ["localhost", "localhost", "127.0.0.1"], epochs
    # The last epoch's rank 0 is a worker that started as rank 2, on the added host.
    assert [e["start_rank"] for e in epochs] == [0, 0, 2], epochs
    # One reset per host change: generations 1, 2, 3.
    assert [e["generation"] for e in epochs] == [1, 2, 3], epochs
    assert_exactly_once(out, 3)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour, exit_mode", [("torch", "exception"), ("tf", "kill")])
def test_single_rank_failure_continues_on_the_other_host(tmp_path, flavour, exit_mode):
    schedule = [[None, ["localhost:2", "127.0.0.1:2"]]]
    code, output, epochs, out = run_scenario(tmp_path, flavour, schedule, "--exit-schedule", '{"1,0": [0]}',
                                             "--exit-mode", exit_mode, np_=4)
    assert code == 0, output[-5000:]
    # Rank 0's host is blacklisted; the job goes on with the two workers of 127.0.0.1.
    assert [e["size"] for e in epochs] == [4, 2, 2], epochs
    assert [e["start_rank"] for e in epochs] == [0, 2, 2], epochs
    # Which host Horovod ranks first varies; the survivors are the other host's.
    first, *rest = [e["hostname"] for e in epochs]
    assert first in ("localhost", "127.0.0.1") and rest == [{"localhost": "127.0.0.1"}.get(first, "localhost")] * 2, \
        epochs
    assert_exactly_once(out, 3)


@pytest.mark.timeout(300)
def test_all_ranks_failing_fails_the_job(tmp_path):
    schedule = [[None, ["localhost:2", "127.0.0.1:2"]]]
    code, output, epochs, _ = run_scenario(tmp_path, "torch", schedule, "--exit-schedule", '{"1,0": [0, 1, 2, 3]}',
                                           np_=4, timeout_s=240)
    assert code != 0, "a job whose every worker failed must fail"
    assert "exited with non-zero status" in output, output[-3000:]
    assert [e["epoch"] for e in epochs] == [0], epochs

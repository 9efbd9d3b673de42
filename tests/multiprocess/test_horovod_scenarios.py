"""Horovod's elastic integration scenarios (its test/integration/elastic_common.py),
for a job that uses elastic_ext's State and run: our own tests of the same
situations, with a PyTorch loop and Keras 3 ``model.fit`` with ElasticCallback.

Covered with PyTorch: hosts added then removed (discovery follows the epochs
rank 0 finished), within a reset limit that allows exactly those resets and
beyond one that does not (the job fails with Horovod's message); a single
rank failing by exception on two hosts; the same with fixed hosts (-H, no
discovery: fault tolerance without scaling), by SIGKILL; a failed host that
comes back after its blacklist cooldown; and every rank failing. Each
successful job also trains every sample exactly once per epoch in its
committed history.

The reset limit, fixed hosts, the blacklist cooldown and the job's failure are
decided by Horovod's driver and elastic_ext's run loop, the same for every
framework, so they run with PyTorch only. ``fit`` keeps the scenario that
reaches its own code: a rank failing by an exception raised inside ``fit``
(it must reach the run loop, not be swallowed, and the survivors roll back
inside ``fit``). TensorFlow's custom loop goes through hosts added and removed
in test_resize.py (elastic_ext's DistributedGradientTape through joins and a
SIGKILL) and through a SIGKILLed rank 0 in test_zoo.py[keras3]; hosts joining
and a SIGKILL inside ``fit`` are test_keras_fit.py's, for Keras 2 and 3.
"""

import json
import os
import sys

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DISCOVERY = os.path.join(launch.WORKERS, "schedule_discovery.py")
BATCHES, GLOBAL_BATCH = 6, 32


def run_scenario(tmp_path, flavour, schedule, *extra, np_=2, min_np=2, max_np=4, timeout_s=300,
                 fixed_hosts=None, horovodrun_args=()):
    """One horovodrun job; hosts from the epoch schedule, or fixed (-H) when fixed_hosts is given."""
    logfile = str(tmp_path / "epochs.jsonl")
    out = tmp_path / "ledger"
    if fixed_hosts:
        hosts = ["-H", fixed_hosts]
    else:
        hosts = ["--max-np", str(max_np), "--host-discovery-script",
                 f"{DISCOVERY} {logfile} '{json.dumps(schedule)}'"]
    cmd = [os.path.join(launch.VENV_BIN, "horovodrun"), "-np", str(np_), "--min-np", str(min_np), *hosts,
           *horovodrun_args, "--network-interfaces", "lo", sys.executable,
           os.path.join(launch.WORKERS, "scenario_train.py"), "--flavour", flavour,
           "--logfile", logfile, "--out", str(out), "--batches", str(BATCHES), *extra]
    # A joining worker imports TF before its first rendezvous; on a loaded
    # 2-core machine that can take longer than Gloo's default 30 s store wait.
    env = launch.base_env(HOROVOD_GLOO_TIMEOUT_SECONDS=120)
    code, output = launch.run(cmd, env, str(tmp_path / "horovodrun.log"), timeout_s)
    epochs = []
    if os.path.exists(logfile):
        with open(logfile) as handle:
            epochs = [json.loads(line) for line in handle if line.strip()]
    return code, output, epochs, out


def assert_exactly_once(out, epochs):
    report = ledger.audit(ledger.read(str(out)), BATCHES * GLOBAL_BATCH, epochs)
    assert report["exactly_once"], report["epochs"]


# One slot per host where the scenario is about the driver's decision: a host
# of two slots only adds a worker to start (its host mate is removed with a
# failed worker in test_single_rank_failure_continues_on_the_other_host[torch]).
ADD_THEN_REMOVE = [[0, ["localhost:1"]], [1, ["localhost:1", "127.0.0.1:1"]], [None, ["127.0.0.1:1"]]]
TWO_HOSTS = [[None, ["localhost:2", "127.0.0.1:2"]]]
TWO_SINGLE_HOSTS = [[None, ["localhost:1", "127.0.0.1:1"]]]


def assert_survivors_on_the_other_host(epochs):
    """Rank 0's host was blacklisted; which host Horovod ranks first varies, so
    the survivors are whichever host the first epoch's rank 0 was not on."""
    first, *rest = [e["hostname"] for e in epochs]
    assert first in ("localhost", "127.0.0.1"), epochs
    assert rest == [{"localhost": "127.0.0.1", "127.0.0.1": "localhost"}[first]] * len(rest), epochs


def assert_went_on_without_rank_0s_host(code, output, epochs, out, slots):
    """Rank 0 failed in epoch 1: its host (``slots`` workers of the 2 x ``slots``) is blacklisted, and the
    job finishes its 3 epochs with the other host's workers (the first world's last ``slots`` ranks),
    exactly once."""
    assert code == 0, output[-5000:]
    assert [e["size"] for e in epochs] == [2 * slots, slots, slots], epochs
    assert [e["start_rank"] for e in epochs] == [0, slots, slots], epochs
    assert [e["generation"] for e in epochs] == [1, 2, 2], epochs
    assert_survivors_on_the_other_host(epochs)
    assert_exactly_once(out, 3)


@pytest.mark.timeout(400)
def test_hosts_added_and_removed(tmp_path):
    # Two host changes are two resets: a reset limit of 2 must let the job finish. After epochs 0
    # and 1 (when the discovery script changes its answer) rank 0 waits for Horovod's notice.
    code, output, epochs, out = run_scenario(tmp_path, "torch", ADD_THEN_REMOVE, "--notice-after", "0,1",
                                             np_=1, min_np=1, max_np=2, horovodrun_args=("--reset-limit", "2"))
    assert code == 0, output[-5000:]
    assert [e["size"] for e in epochs] == [1, 2, 1], epochs
    assert [e["hostname"] for e in epochs] == ["localhost", "localhost", "127.0.0.1"], epochs
    # The last epoch's rank 0 is a worker that started as rank 1, on the added host.
    assert [e["start_rank"] for e in epochs] == [0, 0, 1], epochs
    # One reset per host change: generations 1, 2, 3.
    assert [e["generation"] for e in epochs] == [1, 2, 3], epochs
    assert_exactly_once(out, 3)


@pytest.mark.timeout(400)
def test_reset_limit_exceeded_fails_the_job_with_horovods_message(tmp_path):
    # The same two host changes with a limit of one reset: the second change stops the job.
    code, output, epochs, _ = run_scenario(tmp_path, "torch", ADD_THEN_REMOVE, "--notice-after", "0,1",
                                           np_=1, min_np=1, max_np=2, horovodrun_args=("--reset-limit", "1"))
    assert code != 0, "a job past its reset limit must fail"
    assert "number of resets during elastic job exceeded limit: 1" in output, output[-3000:]
    # Epoch 0 on the first host, epoch 1 after the one allowed reset on both; no third epoch.
    assert [(e["size"], e["generation"]) for e in epochs] == [(1, 1), (2, 2)], epochs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour", ["torch", "keras"])
def test_single_rank_failure_continues_on_the_other_host(tmp_path, flavour):
    # An exception; for Keras raised inside ``fit``, where it must reach the run loop. PyTorch runs
    # two slots per host, so Horovod's driver also removes the failed rank's host mate.
    slots = 2 if flavour == "torch" else 1
    code, output, epochs, out = run_scenario(tmp_path, flavour, TWO_HOSTS if slots == 2 else TWO_SINGLE_HOSTS,
                                             "--exit-schedule", '{"1,0": [0]}', "--exit-mode", "exception",
                                             np_=2 * slots, min_np=slots)
    assert_went_on_without_rank_0s_host(code, output, epochs, out, slots)


@pytest.mark.timeout(400)
def test_fault_tolerance_without_scaling_on_fixed_hosts(tmp_path):
    # No discovery script: the hosts are fixed (-H); the failed host is blacklisted for good.
    # SIGKILL here, an exception in test_single_rank_failure_continues_on_the_other_host.
    code, output, epochs, out = run_scenario(tmp_path, "torch", None, "--exit-schedule", '{"1,0": [0]}',
                                             "--exit-mode", "kill", np_=2, min_np=1,
                                             fixed_hosts="localhost:1,127.0.0.1:1")
    assert_went_on_without_rank_0s_host(code, output, epochs, out, 1)


@pytest.mark.timeout(400)
def test_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    # Rank 1, alone on its host, fails in epoch 1: the host is blacklisted for
    # 1-2 s, then discovery offers it again and the job grows back to two
    # workers (rank 0 waits for that notice at the end of epoch 1). (A host
    # of two slots would also lose its other worker: had that one been left
    # to Horovod's driver to end, it could outlive the 1-2 s cooldown (the
    # driver allows 10 s, and an elastic_ext worker told to go leaves at its
    # next commit), and Horovod would charge its exit to the new worker in
    # its slot (see test_horovodrun.py's replaced-worker test;
    # elastic_ext.launch.horovodrun ignores such exits).)
    code, output, epochs, out = run_scenario(tmp_path, "torch", TWO_SINGLE_HOSTS, "--exit-schedule",
                                             '{"1,0": [1]}', "--epochs", "4", "--notice-after", "1:2", np_=2,
                                             min_np=1, max_np=2,
                                             horovodrun_args=("--blacklist-cooldown-range", "1", "2"))
    assert code == 0, output[-5000:]
    sizes = analysis.sizes_by_generation(ledger.read(str(out)))
    assert sizes[:2] == [[2], [1]] and sizes[-1] == [2], sizes
    assert epochs[0]["size"] == 2 and epochs[-1]["size"] == 2, epochs
    # Rank 0 of the first world stayed rank 0 throughout.
    assert [e["start_rank"] for e in epochs] == [0] * 4, epochs
    assert_exactly_once(out, 4)


@pytest.mark.timeout(300)
def test_all_ranks_failing_fails_the_job(tmp_path):
    code, output, epochs, _ = run_scenario(tmp_path, "torch", TWO_SINGLE_HOSTS, "--exit-schedule",
                                           '{"1,0": [0, 1]}', np_=2, min_np=1, timeout_s=240)
    assert code != 0, "a job whose every worker failed must fail"
    assert "exited with non-zero status" in output, output[-3000:]
    # Neither rank got past epoch 0, though the survivor of the first exit may
    # have rolled back and logged epoch 0 again before its own.
    assert {e["epoch"] for e in epochs} == {0}, epochs

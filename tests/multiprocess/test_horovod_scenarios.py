"""Horovod's elastic integration scenarios (its test/integration/elastic_common.py),
for a job that uses elastic_ext's State and run: our own tests of the same
situations, with a PyTorch loop, a TF2 loop (Keras 3 model, elastic_ext's
DistributedGradientTape) and Keras 3 ``model.fit`` with ElasticCallback.

Covered with PyTorch: hosts added then removed (discovery follows the epochs
rank 0 finished), within a reset limit that allows exactly those resets and
beyond one that does not (the job fails with Horovod's message); a single
rank failing (by exception and by SIGKILL) on two hosts; the same with fixed
hosts (-H, no discovery: fault tolerance without scaling); a failed host that
comes back after its blacklist cooldown; and every rank failing. Each
successful job also trains every sample exactly once per epoch in its
committed history.

The reset limit, fixed hosts, the blacklist cooldown and the job's failure are
decided by Horovod's driver and elastic_ext's run loop, the same for every
framework, so they run with PyTorch only. The TensorFlow flavours run the
scenarios that reach their own code. The TF2 loop (the only job here whose
elastic_ext DistributedGradientTape goes through a rollback or a join;
test_tf_checkpoint_resume.py restarts one from storage): hosts added and
removed (the newcomers' unbuilt Keras optimizer is built and synced from the
survivors through the TF binding, then rank 0 moves to a worker that joined)
and a SIGKILLed rank 0 (rollback, the Keras 3 model and optimizer restored,
a survivor of the other host becomes the sync root). ``fit``: a rank failing
by an exception raised inside ``fit`` (it must reach the run loop, not be
swallowed, and the survivors roll back inside ``fit``); hosts joining and a
SIGKILL inside ``fit`` are test_keras_fit.py's job, for Keras 2 and 3.
"""

import json
import os
import sys

import pytest

from elastic_ext.testing import ledger
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


ADD_THEN_REMOVE = [[0, ["localhost:2"]], [1, ["localhost:2", "127.0.0.1:2"]], [None, ["127.0.0.1:2"]]]
TWO_HOSTS = [[None, ["localhost:2", "127.0.0.1:2"]]]


def assert_survivors_on_the_other_host(epochs):
    """Rank 0's host was blacklisted; which host Horovod ranks first varies, so
    the survivors are whichever host the first epoch's rank 0 was not on."""
    first, *rest = [e["hostname"] for e in epochs]
    assert first in ("localhost", "127.0.0.1"), epochs
    assert rest == [{"localhost": "127.0.0.1", "127.0.0.1": "localhost"}[first]] * len(rest), epochs


def assert_went_on_without_rank_0s_host(code, output, epochs, out):
    """Rank 0 of 4 failed in epoch 1: its host is blacklisted, and the job finishes its 3 epochs
    with the two workers of the other host (ranks 2 and 3 of the first world), exactly once."""
    assert code == 0, output[-5000:]
    assert [e["size"] for e in epochs] == [4, 2, 2], epochs
    assert [e["start_rank"] for e in epochs] == [0, 2, 2], epochs
    assert [e["generation"] for e in epochs] == [1, 2, 2], epochs
    assert_survivors_on_the_other_host(epochs)
    assert_exactly_once(out, 3)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour", ["torch", "tf"])
def test_hosts_added_and_removed(tmp_path, flavour):
    # Two host changes are two resets: a reset limit of 2 must let the job finish.
    code, output, epochs, out = run_scenario(tmp_path, flavour, ADD_THEN_REMOVE, "--epoch-wait-s", "3",
                                             horovodrun_args=("--reset-limit", "2"))
    assert code == 0, output[-5000:]
    assert [e["size"] for e in epochs] == [2, 4, 2], epochs
    assert [e["hostname"] for e in epochs] == ["localhost", "localhost", "127.0.0.1"], epochs
    # The last epoch's rank 0 is a worker that started as rank 2, on the added host.
    assert [e["start_rank"] for e in epochs] == [0, 0, 2], epochs
    # One reset per host change: generations 1, 2, 3.
    assert [e["generation"] for e in epochs] == [1, 2, 3], epochs
    assert_exactly_once(out, 3)


@pytest.mark.timeout(400)
def test_reset_limit_exceeded_fails_the_job_with_horovods_message(tmp_path):
    # The same two host changes with a limit of one reset: the second change stops the job.
    code, output, epochs, _ = run_scenario(tmp_path, "torch", ADD_THEN_REMOVE, "--epoch-wait-s", "3",
                                           horovodrun_args=("--reset-limit", "1"))
    assert code != 0, "a job past its reset limit must fail"
    assert "number of resets during elastic job exceeded limit: 1" in output, output[-3000:]
    # Epoch 0 on the first host, epoch 1 after the one allowed reset on both; no third epoch.
    assert [(e["size"], e["generation"]) for e in epochs] == [(2, 1), (4, 2)], epochs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("flavour, exit_mode", [("torch", "exception"), ("tf", "kill"), ("keras", "exception")])
def test_single_rank_failure_continues_on_the_other_host(tmp_path, flavour, exit_mode):
    code, output, epochs, out = run_scenario(tmp_path, flavour, TWO_HOSTS, "--exit-schedule", '{"1,0": [0]}',
                                             "--exit-mode", exit_mode, np_=4)
    assert_went_on_without_rank_0s_host(code, output, epochs, out)


@pytest.mark.timeout(400)
def test_fault_tolerance_without_scaling_on_fixed_hosts(tmp_path):
    # No discovery script: the hosts are fixed (-H); the failed host is blacklisted for good.
    # SIGKILL here, an exception in test_single_rank_failure_continues_on_the_other_host[torch-exception].
    code, output, epochs, out = run_scenario(tmp_path, "torch", None, "--exit-schedule", '{"1,0": [0]}',
                                             "--exit-mode", "kill", np_=4,
                                             fixed_hosts="localhost:2,127.0.0.1:2")
    assert_went_on_without_rank_0s_host(code, output, epochs, out)


@pytest.mark.timeout(400)
def test_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    # Ranks 2 and 3, one host's workers, fail in epoch 1: the host is blacklisted
    # for 1-2 s, then discovery offers it again and the job grows back to four
    # workers. Both fail, as when a machine is lost: had rank 2 been left to
    # Horovod's driver to end, it could outlive the 1-2 s cooldown (the driver
    # allows 10 s, and an elastic_ext worker told to go leaves at its next
    # commit), and Horovod would charge its exit to the new worker in its slot
    # (see test_horovodrun.py's replaced-worker test; elastic_ext.launch.horovodrun
    # ignores such exits).
    code, output, epochs, out = run_scenario(tmp_path, "torch", TWO_HOSTS, "--exit-schedule", '{"1,0": [2, 3]}',
                                             "--epochs", "4", "--epoch-wait-s", "2", np_=4,
                                             horovodrun_args=("--blacklist-cooldown-range", "1", "2"))
    assert code == 0, output[-5000:]
    sizes = analysis.sizes_by_generation(ledger.read(str(out)))
    assert sizes[:2] == [[4], [2]] and sizes[-1] == [4], sizes
    assert epochs[0]["size"] == 4 and epochs[-1]["size"] == 4, epochs
    # The ranks 0 and 1 of the first world stayed rank 0 and 1 throughout.
    assert [e["start_rank"] for e in epochs] == [0] * 4, epochs
    assert_exactly_once(out, 4)


@pytest.mark.timeout(300)
def test_all_ranks_failing_fails_the_job(tmp_path):
    code, output, epochs, _ = run_scenario(tmp_path, "torch", TWO_HOSTS, "--exit-schedule", '{"1,0": [0, 1, 2, 3]}',
                                           np_=4, timeout_s=240)
    assert code != 0, "a job whose every worker failed must fail"
    assert "exited with non-zero status" in output, output[-3000:]
    assert [e["epoch"] for e in epochs] == [0], epochs

"""Keras under real horovodrun, Keras 2 (tf_keras) and Keras 3: the gradient API
against Horovod's numbers, and ``model.fit`` made elastic by ElasticCallback.

The fit job goes through every kind of world change in one run (cheaper than
one job each): a host added mid-epoch, a SIGKILL mid-epoch (rollback, the
victim's host is blacklisted), another host added, and a SIGTERMed worker
that leaves at its next commit. It must finish with identical weights on
every rank, every sample exactly once per epoch in the committed history, and
the same bits as a failure-free run whose host file follows the same world
sizes at the same steps. That reference run, once trained, also compares
elastic_ext's gradient API (DistributedGradientTape's options, a local
source, DistributedOptimizer in ``fit``) with Horovod's numbers on its last
world of two ranks (workers/keras_grads.py).
"""

import json
import os
import socket

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
GLOBAL_BATCH = 128  # 15 steps per epoch (the last one padded), whatever the world size
EPOCHS = 2
BASE = "localhost:2"
OTHER = "127.0.0.1:1"
THIRD = f"{socket.gethostname()}:1"


def assert_gradient_api_gives_horovods_numbers(out):
    """keras_grads.py's results on the two ranks of a job's last world (``--grad-checks``)."""
    results = [json.load(open(out / f"grads-{rank}.json")) for rank in (0, 1)]
    for rank, result in enumerate(results):
        for name, outcome in result.items():
            if name == "fit_weights_sha256":
                continue
            if name == "fit_without_reduction":
                # Training without the reduction must give other weights, or
                # the comparisons above could not tell reduced from local.
                assert outcome["max_abs_diff"] > 1e-3, ("phase 'gradient API'", rank, name, outcome)
            else:
                # Same Horovod collectives with the same op and scale factors
                # on the same tensors: nothing may differ, not even the last bit.
                assert outcome["bitwise"], ("phase 'gradient API'", rank, name, outcome)
    assert results[0]["fit_weights_sha256"] == results[1]["fit_weights_sha256"], \
        "phase 'gradient API': ranks trained apart"
    # The checksums of reduced gradients agree between ranks (they were reduced).
    assert results[0]["tape_average"]["checksum"] == results[1]["tape_average"]["checksum"], \
        "phase 'gradient API': the tape's gradients differ between ranks"


def run_fit(tmp_path, name, keras, *worker_args, timeout_s=300):
    out = tmp_path / name
    out.mkdir()
    hosts = str(out / "hosts")
    launch.write_hosts(hosts, [BASE])
    cmd = launch.elastic_cmd(2, 1, 4, hosts, "keras_fit.py", "--out", str(out), "--keras", keras,
                             "--epochs", str(EPOCHS), "--global-batch", str(GLOBAL_BATCH),
                             "--commit-every", str(COMMIT_EVERY), *worker_args)
    # A joining worker imports TF and Keras before its first rendezvous; on a
    # loaded 2-core machine that took over Gloo's default 30 s store wait and
    # aborted the job. Failures are detected by elastic_ext, not this timeout.
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), HOROVOD_GLOO_TIMEOUT_SECONDS=120)
    code, output = launch.run(cmd, env, str(out / "horovodrun.log"), timeout_s)
    assert code == 0, output[-5000:]
    return out, hosts


@pytest.mark.timeout(900)
@pytest.mark.parametrize("keras", ["2", "3"])
def test_fit_survives_kill_grow_and_leave_exactly_once_and_bitwise(tmp_path, keras):
    # 15 steps per epoch; commits after steps 4, 8, 12, 15 (epoch end), 19,
    # 23, 27, 30. Steps 0-7 on 2 workers; at the commit of step 8 a host
    # joins (3); rank 2 is SIGKILLed at the start of step 13 (rollback to 12,
    # its host blacklisted: 2); at 19 another host joins (3); its worker gets
    # SIGTERM at step 22 and leaves at the commit of step 23 (2).
    failed_hosts = str(tmp_path / "failed" / "hosts")
    failed, _ = run_fit(tmp_path, "failed", keras, "--side-callbacks", "--faults", "2:13:kill,2:22:term",
                        "--resize-at", f"8:{failed_hosts}:{BASE},{OTHER};19:{failed_hosts}:{BASE},{THIRD}")
    records = ledger.read(str(failed))
    sizes = analysis.sizes_by_generation(records)
    assert sizes == [[2], [3], [2], [3], [2]], sizes
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == [0, 8, 12, 19, 23], starts
    events = analysis.read_events(str(failed / "events.jsonl"))
    # Every surviving rank writes its own events: count rollbacks by the commit they went back to.
    assert len({e["commit_id"] for e in events if e["event"] == "rollback"}) == 1, "one rollback (the SIGKILL)"
    assert len([e for e in events if e["event"] == "leave"]) == 1, "the SIGTERMed worker must leave"
    report = analysis.assert_exactly_once(failed, DIGITS, EPOCHS)
    assert report["lost_steps"] >= 1, "the step the SIGKILL interrupted must have been thrown away"
    finals = analysis.load_finals(failed)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
    # The side callbacks of rank 0 ran alongside: one checkpoint per epoch, TensorBoard events.
    names = sorted(os.listdir(failed))
    assert [n for n in names if n.startswith("ckpt-")] and "tensorboard" in names, names

    reference_hosts = str(tmp_path / "reference" / "hosts")
    # The reference also checks the gradient API against Horovod's once it has trained, in its
    # last world (2 ranks): a phase of its own rather than a job of its own.
    reference, _ = run_fit(
        tmp_path, "reference", keras, "--grad-checks",
        "--resize-at", f"8:{reference_hosts}:{BASE},{OTHER};12:{reference_hosts}:{BASE};"
                       f"19:{reference_hosts}:{BASE},{THIRD};23:{reference_hosts}:{BASE}")
    reference_records = ledger.read(str(reference))
    assert analysis.sizes_by_generation(reference_records) == [[2], [3], [2], [3], [2]]
    analysis.assert_bitwise_equal(finals[0], analysis.load_finals(reference)[0], "failed run vs reference")
    assert_gradient_api_gives_horovods_numbers(reference)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("keras", ["2", "3"])
def test_fit_guard_skips_a_nan_batch_once_and_a_straggler_is_evicted(tmp_path, keras):
    # 3 workers (BASE's 2 slots, OTHER's 1), 15 steps per epoch, a commit every 4 batches and at each
    # epoch's end. Phase 1: rank 1's loss is NaN at step 6; every rank rolls back to the commit of
    # step 4 (which restarts the straggler warm-up: 4 steps) and the fit call after it leaves step
    # 6's samples out: epoch 0 has 14 steps, commits after steps 8, 12, 14, then 18, 22, 26, 29.
    # Phase 2: OTHER's only worker (whichever rank Horovod gave it: it orders hosts as it likes)
    # computes 5x longer from step 12 (30 ms of simulated compute per step inside the training
    # graph); under StragglerPolicy(3, window 8, warm-up 4) it is
    # slow from the observation that began at step 12 and evicted at the commit of step 22 (slow for
    # 10 steps), with no rollback.
    out = tmp_path / "soft"
    out.mkdir()
    hosts = str(out / "hosts")
    launch.write_hosts(hosts, [BASE, OTHER])
    cmd = launch.elastic_cmd(3, 2, 3, hosts, "keras_fit.py", "--out", str(out), "--keras", keras,
                             "--epochs", str(EPOCHS), "--global-batch", str(GLOBAL_BATCH),
                             "--commit-every", str(COMMIT_EVERY), "--guard", "--nan", "1:6",
                             "--straggler", "3:8:4", "--compute-s", "0.03", "--slow", f"{OTHER.split(':')[0]}:12:5")
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), HOROVOD_GLOO_TIMEOUT_SECONDS=120)
    code, output = launch.run(cmd, env, str(out / "horovodrun.log"), 500)
    assert code == 0, output[-5000:]
    events = analysis.read_events(str(out / "events.jsonl"))

    numeric = [e for e in events if e["event"] == "numeric_rollback"]
    assert sorted(e["rank"] for e in numeric) == [0, 1, 2], f"phase 'nan': one numeric_rollback per rank: {numeric}"
    for event in numeric:
        assert (event["step"], event["reason"], event["bad_ranks"]) == (6, "nonfinite_loss", [1]), event
        assert event["commit_id"] == 1 and event["steps_rolled_back"] == 2, event
        assert event["skipped"] == [["sampler", 0, 6 * GLOBAL_BATCH, 7 * GLOBAL_BATCH]], event
    assert not [e for e in events if e["event"] == "rollback"], "phase 'nan': no Horovod reset for a numeric fault"

    decisions = [e for e in events if e["event"] == "straggler"]
    evicted = [e for e in decisions if "host" in e]  # the evicted rank's own decision names its host
    assert len(evicted) == 1 and evicted[0]["rank"] == evicted[0]["evicted_rank"], f"phase 'straggler': {decisions}"
    slow_rank = evicted[0]["evicted_rank"]
    assert len(decisions) == 3 and {(e["evicted_rank"], e["step"]) for e in decisions} == {(slow_rank, 22)}, \
        f"phase 'straggler': {decisions}"
    assert all(e["slow_since"] == 12 and e["ratio"] >= 3 for e in decisions), decisions
    leaves = [e for e in events if e["event"] == "leave"]
    assert [(e["rank"], e["cause"]) for e in leaves] == [(slow_rank, "straggler")], f"phase 'straggler': {leaves}"
    assert (out / "exclude").read_text().split()[0] == evicted[0]["host"] == OTHER.split(":")[0]

    records = ledger.read(str(out))
    report = analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    assert [e["skipped"] for e in report["epochs"]] == [GLOBAL_BATCH, 0], report["epochs"]
    assert analysis.sizes_by_generation(records)[-1] == [2], analysis.sizes_by_generation(records)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)

"""The numeric guard under real horovodrun: a NaN on one rank rolls every rank back and skips its samples.

Two workers (PyTorch, TensorFlow/Keras 3), each a small network with
BatchNorm and dropout; the NaN is injected by the worker into one rank's
input batch at a chosen global step, once.
"""

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

SAMPLES = 1792  # 28 steps of 64 per epoch, no remainder
EPOCHS = 2
COMMIT_EVERY = 4
GLOBAL_BATCH = 64


@pytest.mark.timeout(400)
@pytest.mark.parametrize("worker", ["train_torch_nan.py", "train_tf_nan.py"])
def test_a_nan_on_one_rank_rolls_back_once_skips_its_step_and_training_finishes(tmp_path, worker):
    nan_step, nan_rank = 10, 1   # between commits 8 and 12
    out = tmp_path / "nan"
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, ["localhost:2"])
    cmd = launch.elastic_cmd(2, 2, 2, hosts_file, worker, "--out", str(out), "--epochs", str(EPOCHS),
                             "--commit-every", str(COMMIT_EVERY), "--global-batch", str(GLOBAL_BATCH),
                             "--samples", str(SAMPLES), "--nan-step", str(nan_step), "--nan-rank", str(nan_rank))
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl")),
                              str(out / "horovodrun.log"), 300)
    assert code == 0, output[-5000:]
    assert f"elastic_ext from {launch.REPO}/elastic_ext/__init__.py" in output, "workers imported another checkout"

    events = analysis.read_events(str(out / "events.jsonl"))
    numeric = [e for e in events if e["event"] == "numeric_rollback"]
    assert sorted(e["rank"] for e in numeric) == [0, 1], f"one numeric_rollback per rank expected: {numeric}"
    # PyTorch judges a step at the next guard_step (its allgather ran in the background meanwhile);
    # TensorFlow's signal rode on the step's own gradient allreduce: judged at once.
    judged_later = 1 if "torch" in worker else 0
    for event in numeric:
        assert (event["step"], event["reason"], event["bad_ranks"]) == (nan_step, "nonfinite_loss", [nan_rank])
        assert event["commit_id"] == nan_step // COMMIT_EVERY and event["rollbacks_in_a_row"] == 1
        assert event["steps_rolled_back"] == nan_step % COMMIT_EVERY + judged_later
        assert event["skipped"] == [["sampler", 0, nan_step * GLOBAL_BATCH, (nan_step + 1) * GLOBAL_BATCH]]
    assert not [e for e in events if e["event"] in ("rollback", "reset", "rollback_limit")], "no Horovod reset expected"
    assert sorted(e["rank"] for e in events if e["event"] == "finish") == [0, 1]

    records = ledger.read(str(out))
    report = analysis.assert_exactly_once(out, SAMPLES, EPOCHS)
    assert [e["skipped"] for e in report["epochs"]] == [GLOBAL_BATCH, 0]
    skipped = {tuple(r["skipped"]) for r in records if "skipped" in r}
    assert skipped == {(0, nan_step * GLOBAL_BATCH, (nan_step + 1) * GLOBAL_BATCH)}
    history = ledger.committed_history(records)
    assert not [r for r in history if r["epoch"] == 0 and r["cursor"] == nan_step * GLOBAL_BATCH], \
        "the bad step's samples were processed in the committed history"

    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
    assert all(value.size and (value == value).all() for value in finals[0].values()), "non-finite final weights"

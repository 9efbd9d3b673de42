"""The model zoo under real horovodrun: models with per-rank state (BatchNorm
statistics, dropout streams, a per-rank metric), each through a SIGKILL with
two survivors and a scale-up, finishing with identical parameters on every
rank; and a removal-only resize whose freed slot a newcomer fills.

The TensorFlow models are also this suite's custom TF training loops under a
SIGKILL, one kill place each: Keras 3 loses rank 0 (its model and optimizer
are restored, and a survivor of the other host becomes the sync root), Keras 2
loses a rank while it copies a commit (the survivors made that commit and
fail in the commit's own collective, through elastic_ext's TF binding: they
resume at it, nothing lost). That a rollback restores both Keras versions
bitwise is checked in one process (tests/unit/test_tf_state.py,
tests/unit/test_tf_gradients.py) and under horovodrun with ``model.fit``
(test_keras_fit.py).

Pseudo-hosts: ``localhost``, ``127.0.0.1`` and this machine's own name, which
Horovod runs locally (no ssh).
"""

import glob
import json
import os

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4


def synced_records(out):
    records = []
    for path in glob.glob(os.path.join(out, "synced-*.jsonl")):
        pid = int(os.path.basename(path)[len("synced-"):-len(".jsonl")])
        with open(path) as handle:
            records.extend(dict(json.loads(line), pid=pid) for line in handle if line.strip())
    return records


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, fault, resumes_at", [
    # The Keras jobs run alone on the machine (exclusive): a stall timeout of 10 s (see below).
    # Rank 0 dies between steps: back to commit 1 (step 4).
    pytest.param("keras3", "0:6:kill", 4, marks=pytest.mark.exclusive),
    # Rank 3 dies copying commit 2: the survivors hold it.
    pytest.param("keras2", "3:8:kill:commit", 8, marks=pytest.mark.exclusive),
    ("torch", "3:6:kill", None),
])
def test_zoo_survives_a_sigkill_and_a_scale_up_with_identical_parameters(tmp_path, model, fault, resumes_at):
    out = tmp_path / "job"
    out.mkdir()
    hosts = str(out / "hosts")
    # Two pseudo-hosts of 2 slots. Horovod orders the hosts as it likes, so
    # which host the victim lands on is not fixed; either way its SIGKILL
    # gets that host blacklisted (its other worker is removed with it) and
    # leaves the two workers of the other host, whose BatchNorm statistics
    # differ (each saw its own batches). At step 12 a third host joins: a
    # full sync. (With 2+1 slots, the lone worker was sometimes rank 1, and
    # the kill of rank 2 then left a single survivor below min-np.)
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"])
    cmd = launch.elastic_cmd(4, 2, 4, hosts, "zoo.py", "--out", str(out), "--model", model, "--epochs", "1",
                             "--commit-every", str(COMMIT_EVERY), "--faults", fault,
                             "--resize-at", f"12:{hosts}:localhost:2,127.0.0.1:2,{launch.third_host()}:1")
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"))
    if model.startswith("keras"):
        # Rank 0 busy 15 s outside any collective (marking progress) while the
        # others wait in the step's allreduce inside @tf.function: graph code,
        # no Python frame of Horovod. The stall check must not fire on them.
        # (10 s, not less: right after the SIGKILL a survivor's main thread can wait
        # seconds in a tensor's numpy(), a C call behind the failed collective while
        # Horovod finalizes, where the stall check sees no Horovod or executor frame.)
        cmd += ["--busy", "0:20:15"]
        env["ELASTIC_EXT_STALL_TIMEOUT_S"] = "10"
    code, output = launch.run(cmd, env, str(out / "horovodrun.log"), timeout_s=270)
    assert code == 0, output[-5000:]
    assert "StateDivergenceError" not in output, output[-5000:]
    events = analysis.read_events(str(out / "events.jsonl"))
    assert not [e for e in events if e["event"] == "stall"], [e for e in events if e["event"] == "stall"]
    recovered = [e for e in events if e["event"] == "recovered"]
    assert sorted(e["cause"] for e in recovered if e["rank"] == 0) == ["collective_failed", "hosts_updated"], \
        recovered

    # Right after every sync each rank holds the root's parameters and buffers.
    records = synced_records(str(out))
    by_gen = {}
    for r in records:
        by_gen.setdefault(r["gen"], []).append(r)
    assert [sorted(r["rank"] for r in by_gen[g]) for g in sorted(by_gen)] == [[0, 1, 2, 3], [0, 1], [0, 1, 2]], by_gen
    for gen, rows in by_gen.items():
        assert rows[0]["n_buffers"] >= 2, rows  # BatchNorm's statistics
        assert len({(r["params"], r["buffers"]) for r in rows}) == 1, (gen, rows)
    victim = int(fault.split(":")[0])
    first = {r["rank"]: r["pid"] for r in by_gen[1]}
    mates = {0: {0, 1}, 1: {0, 1}, 2: {2, 3}, 3: {2, 3}}[victim]  # ranks 0-1 and 2-3 share a host
    survivors = {r["pid"] for r in by_gen[2]}
    assert survivors == {first[rank] for rank in {0, 1, 2, 3} - mates}, \
        f"generation 2 must be the other host's workers: ranks by pid {first}, survivors {survivors}"
    if resumes_at is not None:
        starts = ledger.starts(ledger.read(str(out)))
        assert starts[2][2] == resumes_at, f"resumed at step {starts[2][2]}, expected {resumes_at}"

    analysis.assert_exactly_once(out, DIGITS, 1)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2]
    analysis.assert_ranks_identical(finals)
    # The per-rank metric stayed each rank's own (never broadcast).
    metrics = [json.load(open(path))["metric"] for path in glob.glob(str(out / "metric-*.json"))]
    assert len(metrics) == 3 and len({tuple(m) for m in metrics}) == 3, metrics


@pytest.mark.timeout(240)
def test_removal_only_resize_with_a_spare_slot_finishes_exactly_once(tmp_path):
    """Rank 1 is told to leave (SIGTERM) at step 10: the commit of step 12 carries the leave;
    PyTorch's commit overlaps its collective with the next steps, so every rank reads it, and
    the worker leaves, at step 16's (commit 4), without a rollback and without losing a step.
    Horovod's driver fills its slot from the spare third host. The survivor and the newcomer
    must meet in the same first collective (they used to wait forever in two different
    allgathers)."""
    out = tmp_path / "job"
    out.mkdir()
    hosts = str(out / "hosts")
    launch.write_hosts(hosts, ["localhost:1", "127.0.0.1:1", f"{launch.third_host()}:1"])
    cmd = launch.elastic_cmd(2, 1, 2, hosts, "train_torch.py", "--out", str(out), "--epochs", "1",
                             "--commit-every", "4", "--faults", "1:10:term")
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl")),
                              str(out / "horovodrun.log"), timeout_s=200)
    assert code == 0, output[-5000:]
    events = analysis.read_events(str(out / "events.jsonl"))
    assert "rollback" not in {e["event"] for e in events}, "a SIGTERMed worker must not cause a rollback"
    leaves = [e for e in events if e["event"] == "leave"]
    assert [(e["rank"], e["commit_id"]) for e in leaves] == [(1, 4)], leaves
    resizes = [e for e in events if e["event"] == "resize" and e["rank"] == 0]
    assert resizes and resizes[0]["skip_sync"] is True, resizes
    syncs = [e for e in events if e["event"] == "sync" and e.get("newcomers")]
    assert any(e["generation"] == 2 and e["newcomers"] == 1 for e in syncs), syncs  # the slot was filled
    assert ledger.starts(ledger.read(str(out)))[2][2] == 16, "the job must resume where the leaver committed"
    report = analysis.assert_exactly_once(out, DIGITS, 1)
    assert report["lost_steps"] == 0, "no step may be thrown away"
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)

"""TensorFlow (Keras 2 via tf_keras, and Keras 3) under @elastic_ext.run with real horovodrun."""

import pytest

from elastic_ext.testing import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
HOSTS = ["localhost:2", "127.0.0.1:2"]


def run_elastic(tmp_path, name, keras, *worker_args, timeout_s=300):
    out = tmp_path / name
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, HOSTS)
    cmd = launch.elastic_cmd(4, 2, 4, hosts_file, "train_tf.py", "--out", str(out), "--keras", keras,
                             "--commit-every", str(COMMIT_EVERY), *worker_args)
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl")),
                              str(out / "horovodrun.log"), timeout_s)
    assert code == 0, output[-5000:]
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("keras", ["2", "3"])
@pytest.mark.parametrize("where, kill_step, resumes_at", [
    ("allreduce", 10, 8),
    ("commit", 12, 12),
])
def test_sigkill_rolls_back_and_finishes_on_the_survivors(tmp_path, keras, where, kill_step, resumes_at):
    out = run_elastic(tmp_path, "failed", keras, "--faults", f"3:{kill_step}:kill:{where}")
    events = analysis.read_events(str(out / "events.jsonl"))
    assert [e for e in events if e["event"] == "rollback"], "the SIGKILL did not cause a rollback"
    analysis.assert_exactly_once(out, DIGITS, 1)
    analysis.assert_no_step_went_back_past_a_commit(out, COMMIT_EVERY)
    starts = ledger.starts(ledger.read(str(out)))
    assert starts[2][2] == resumes_at
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
    if where == "allreduce":
        hosts_file = tmp_path / "reference" / "hosts"
        reference = run_elastic(tmp_path, "reference", keras, "--resize-at", f"{resumes_at}:{hosts_file}:localhost:2")
        analysis.assert_bitwise_equal(finals[0], analysis.load_finals(reference)[0], "failed run vs reference")

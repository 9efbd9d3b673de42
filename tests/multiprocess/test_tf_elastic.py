"""TensorFlow (Keras 2 via tf_keras, and Keras 3) under @elastic_ext.run with real horovodrun.

A custom training loop (train_tf.py: tape, then ``hvd.allreduce`` of each
gradient) SIGKILLed at one of two places, which reach different code: inside
the gradient allreduce (the survivors' Horovod op fails, they go back to
commit 8), or while the victim copies commit 12 (the survivors made commit
12 and fail in the commit's own collective, through elastic_ext's TF
binding; they resume at 12). Each place runs on one Keras version, so both
versions' adapters are restored in a real job here; the Keras-3 allreduce
case also ends bitwise where the failure-free run with the same world sizes
ends. Both Keras versions' rollbacks are also checked bitwise, in one process
(tests/unit/test_tf_state.py, tests/unit/test_tf_gradients.py) and under
horovodrun with ``model.fit`` (tests/multiprocess/test_keras_fit.py).
"""

import pytest

from elastic_ext.testing import ledger
from tests.multiprocess import analysis, launch
from tests.multiprocess.references import references  # noqa: F401  (the session's shared runs)

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


def run_reference(directory, keras, resumes_at):
    """The failed job's world sizes without the failure: 4 workers until commit ``resumes_at``,
    then the second host leaves gracefully."""
    hosts_file = directory / "reference" / "hosts"
    return analysis.load_finals(run_elastic(directory, "reference", keras,
                                            "--resize-at", f"{resumes_at}:{hosts_file}:localhost:2"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("keras, where, kill_step, resumes_at", [
    ("3", "allreduce", 10, 8),
    ("2", "commit", 12, 12),
])
def test_sigkill_rolls_back_and_finishes_on_the_survivors(tmp_path, references, keras, where, kill_step, resumes_at):
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
        reference = references.get(("train_tf.py", keras, COMMIT_EVERY, resumes_at),
                                   lambda directory: run_reference(directory, keras, resumes_at))
        analysis.assert_bitwise_equal(finals[0], reference[0], "failed run vs reference")

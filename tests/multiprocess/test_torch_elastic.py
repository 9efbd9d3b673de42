"""PyTorch under @elastic_ext.run with real horovodrun on two pseudo-hosts.

One optimizer (Adam) here: that restore is bitwise for Adam, AdamW and SGD
with momentum is the unit tier's job
(tests/unit/test_state.py::test_restore_is_bitwise_for_model_optimizer_and_scheduler).
The failure-free reference of a SIGKILL test depends only on the commit the
job resumes at, so tests that resume at the same commit share one launch
(tests/multiprocess/references.py).
"""


import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch
from tests.multiprocess.references import references  # noqa: F401  (the session's shared runs)

# With the guardian on, as users run: a SIGKILL can leave the killed worker's host mate deadlocked
# in Horovod's native code. Seen once in CI: its main thread stayed inside the extension's allreduce
# enqueue (which holds the GIL) after Horovod's background loop had died on the dead peer's
# connection reset, so no thread of it ran, it never raised, and the others waited for it until the
# test's timeout. The guardian kills a worker whose heartbeat stops while it uses no CPU, which
# turns that hang into one more failed worker on the failed host.
USER_DEFAULTS = True

DIGITS = 1797
EPOCHS = 2
COMMIT_EVERY = 4
HOSTS = ["localhost:2", "127.0.0.1:2"]


def run_elastic(tmp_path, name, *worker_args, np_=4, hosts=HOSTS, timeout_s=240, env=None):
    out = tmp_path / name
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, hosts)
    cmd = launch.elastic_cmd(np_, 2, 4, hosts_file, "train_torch.py", "--out", str(out),
                             "--epochs", str(EPOCHS), "--commit-every", str(COMMIT_EVERY), *worker_args)
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), **(env or {})),
                              str(out / "horovodrun.log"), timeout_s)
    assert code == 0, output[-5000:]
    return out


def run_plain(tmp_path, name, *worker_args, np_=2):
    out = tmp_path / name
    out.mkdir()
    cmd = launch.static_cmd(np_, "train_torch.py", "--out", str(out), "--mode", "plain",
                            "--epochs", str(EPOCHS), "--commit-every", str(COMMIT_EVERY), *worker_args)
    code, output = launch.run(cmd, launch.base_env(), str(out / "horovodrun.log"), 180)
    assert code == 0, output[-5000:]
    return out


def run_reference(directory, resumes_at):
    """The world-size schedule of a SIGKILL test without the failure: 4 workers until commit
    ``resumes_at``, then the second host leaves gracefully. Asserts that it never rolls back.

    PyTorch's commit overlaps its collective with the steps after it, so the host's removal,
    announced before the commit one interval earlier, takes effect at ``resumes_at``."""
    hosts_file = directory / "reference" / "hosts"
    reference = run_elastic(directory, "reference", "--optimizer", "adam",
                            "--resize-at", f"{resumes_at - COMMIT_EVERY}:{hosts_file}:localhost:2")
    resized = ledger.starts(ledger.read(str(reference)))
    assert resized[2][2] == resumes_at, f"the reference resized at step {resized[2][2]}, expected {resumes_at}"
    ref_events = analysis.read_events(str(reference / "events.jsonl"))
    assert not [e for e in ref_events if e["event"] == "rollback"], "the reference run must not roll back"
    return analysis.load_finals(reference)


@pytest.mark.timeout(600)
def test_failure_free_elastic_equals_plain_horovod(tmp_path):
    elastic = run_elastic(tmp_path, "elastic", "--optimizer", "adam", np_=2, hosts=["localhost:2"])
    plain = run_plain(tmp_path, "plain", "--optimizer", "adam")
    finals_e, finals_p = analysis.load_finals(elastic), analysis.load_finals(plain)
    analysis.assert_ranks_identical(finals_e)
    assert sorted(finals_e) == sorted(finals_p) == [0, 1]
    analysis.assert_bitwise_equal(finals_e[0], finals_p[0], "elastic vs plain (adam)")
    analysis.assert_exactly_once(elastic, DIGITS, EPOCHS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where, kill_step, resumes_at", [
    # A gradient allreduce in flight: back to commit 8. (A kill between steps reaches the
    # survivors the same way, through their next allreduce; test_zoo.py and test_examples.py
    # kill there.)
    ("allreduce", 10, 8),
    ("commit", 12, 12),     # while commit 12 copies: survivors hold 12, nothing is lost
])
def test_sigkill_rolls_back_and_matches_a_failure_free_run(tmp_path, references, where, kill_step, resumes_at):
    # Rank 3 lives on the second pseudo-host; Horovod blacklists that host, so 4 -> 2 workers.
    failed = run_elastic(tmp_path, "failed", "--optimizer", "adam", "--faults", f"3:{kill_step}:kill:{where}")
    events = analysis.read_events(str(failed / "events.jsonl"))
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks, "the SIGKILL did not cause a rollback"
    # The worker's 2 MiB table was restored on the background thread, beside Horovod's re-forming.
    recovered = [e for e in events if e["event"] == "recovered" and e["cause"] == "collective_failed"]
    assert recovered and all("restore_background_s" in e for e in recovered), recovered
    # Each reset's event breaks Horovod's re-init down: its shutdown is timed apart.
    resets = [e for e in events if e["event"] == "reset"]
    assert resets and all(0 <= e["shutdown_s"] <= e["reinit_s"] for e in resets), resets
    analysis.assert_exactly_once(failed, DIGITS, EPOCHS)
    analysis.assert_no_step_went_back_past_a_commit(failed, COMMIT_EVERY)
    starts = ledger.starts(ledger.read(str(failed)))
    assert starts[2][2] == resumes_at, f"resumed at step {starts[2][2]}, expected {resumes_at}"
    finals = analysis.load_finals(failed)
    assert sorted(finals) == [0, 1], "expected the job to end on the two workers of the first host"
    analysis.assert_ranks_identical(finals)

    # The reference depends only on the commit the job resumes at (references.py).
    reference = references.get(("train_torch.py", "adam", EPOCHS, COMMIT_EVERY, resumes_at),
                               lambda directory: run_reference(directory, resumes_at))
    analysis.assert_bitwise_equal(finals[0], reference[0], "failed run vs reference")

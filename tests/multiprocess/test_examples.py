"""The examples run for real as their docstrings say (``elastic-horovodrun``), survive a
SIGKILL, learn, and see every sample exactly once: the PyTorch loop, the
TensorFlow loop (Keras 3) and ``model.fit`` (Keras 2).

Each job has a hard timeout (launch.run kills the whole process tree on
expiry) under pytest's own. Epochs are few to keep CI short; the digits
reach ~0.95 test accuracy in three, so the bound (0.85) only catches a
run that did not really learn.
"""

import os
import re
import sys

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

USER_DEFAULTS = True  # what users run: the guardian on, as by default (see tests/conftest.py)
EXAMPLES = os.path.join(launch.REPO, "examples")
TRAIN_SIZE = 1500  # digits minus the 297 held out, in both examples
EPOCHS = 3
MIN_ACCURACY = 0.85
RANK0 = re.compile(r"^\[0\]<stdout>:(.*)$", re.MULTILINE)


def run_example(tmp_path, script, hosts, np_, min_np, *script_args, watch_args=(), timeout_s=150):
    """Runs an example elastically on the pseudo-hosts ``hosts``, watched from outside its code
    (:mod:`devkit.watched`: ``watch_args``, the sample ledger); returns (rank 0's lines, out dir)."""
    out = tmp_path / "job"
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, hosts)
    cmd = [os.path.join(launch.VENV_BIN, "elastic-horovodrun"), "-np", str(np_), "--min-np", str(min_np),
           "--max-np", str(np_), "--network-interfaces", "lo",
           "--host-discovery-script", f"{launch.STATIC} {hosts_file}",
           sys.executable, "-m", "devkit.watched", "--ledger", str(out / "ledger"), *watch_args,
           "--", os.path.join(EXAMPLES, script), "--epochs", str(EPOCHS), *script_args]
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"))
    code, output = launch.run(cmd, env, str(out / "horovodrun.log"), timeout_s)
    assert code == 0, f"exit code {code}; output tail:\n{output[-5000:]}"
    return RANK0.findall(output), out


def final_accuracy(lines):
    done = [re.search(r"^done: test accuracy ([0-9.]+) after \d+ steps on (\d+) workers", line) for line in lines]
    done = [m for m in done if m]
    assert len(done) == 1, f"expected one 'done:' line from rank 0, got: {lines}"
    return float(done[0].group(1)), int(done[0].group(2))


def assert_killed_and_recovered(lines, out, kill_step, commit_every, survivors, printed=True, rolled_back=None,
                                back_to=None):
    """A rollback to the commit before ``kill_step``, then training on ``survivors`` workers to the end,
    or until the failed slot's new worker joins (``back_to`` workers).

    ``rolled_back``: the steps since that commit (default: commits every ``commit_every`` steps).

    ``printed``: the example prints its recoveries and resets (the loops do;
    ``model.fit``'s example leaves them to the event log).
    """
    events = analysis.read_events(str(out / "events.jsonl"))
    assert any(e["event"] == "rollback" for e in events), "the SIGKILL did not cause a rollback"
    resume = kill_step - (kill_step % commit_every if rolled_back is None else rolled_back)
    recovered = [e for e in events if e["event"] == "recovered" and e["rank"] == 0 and e["cause"] == "collective_failed"]
    assert [e["steps_rolled_back"] for e in recovered] == [kill_step - resume], recovered
    if printed:
        expected = ("[elastic] recovered from collective_failed in ", f"{kill_step - resume} steps rolled back, "
                    f"resuming at step {resume}")
        assert [line for line in lines if line.startswith(expected[0]) and line.endswith(expected[1])], \
            f"no recovery line like {expected} in rank 0's output: {lines}"
        assert f"[elastic] reset: the job now has {survivors} workers" in lines, lines
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == EPOCHS, lines
    assert int(epochs[-1].split("workers ")[1].split()[0]) in {survivors, back_to or survivors}, epochs[-1]
    if back_to is not None and printed:
        assert f"[elastic] reset: the job now has {back_to} workers" in lines, lines


def assert_exactly_once(out):
    report = ledger.audit(ledger.read(str(out / "ledger")), TRAIN_SIZE, EPOCHS)
    assert report["exactly_once"], f"not exactly once: {report['epochs']}"
    assert [e["processed"] for e in report["epochs"]] == [TRAIN_SIZE] * EPOCHS, report["epochs"]
    return report


@pytest.mark.timeout(200)
def test_pytorch_example_survives_a_sigkill_on_four_workers(tmp_path):
    # Rank 3 is killed on a pseudo-host of 2 slots. Horovod's driver would blacklist
    # its host and remove the host's healthy worker too (the job would go on with 2);
    # the launcher keeps the host, whose other worker recorded itself ready: the 3
    # survivors go on at once, and a new worker started early in the failed slot joins
    # them at a later commit (at the latest at the job's end), so the job ends with 4.
    kill_step, commit_every = 28, 5
    lines, out = run_example(tmp_path, "pytorch_elastic.py", ["localhost:2", "127.0.0.1:2"], 4, 2,
                             "--commit-every", str(commit_every), watch_args=("--faults", f"3:{kill_step}:kill"))
    accuracy, workers = final_accuracy(lines)
    assert accuracy > MIN_ACCURACY, lines
    assert workers == 4, lines
    assert_killed_and_recovered(lines, out, kill_step, commit_every, survivors=3, back_to=4)
    output = (out / "horovodrun.log").read_text()
    assert "has been removed from elastic job" not in output, "the killed worker's host mate was removed"
    assert re.search(r"not blacklisting (localhost|127\.0\.0\.1): another of its workers is ready", output), \
        output[-5000:]
    report = assert_exactly_once(out)
    assert report["lost_steps"] >= 1, "the steps after the last commit should have been thrown away"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("script, keras, rolled_back", [("tensorflow_elastic.py", "3", 3),
                                                      ("keras_fit_elastic.py", "2", 4)],
                         ids=["loop-keras3", "fit-keras2"])
def test_tensorflow_examples_survive_a_sigkill_on_two_workers(tmp_path, script, keras, rolled_back):
    # One slot on each pseudo-host, so that losing rank 1 (and its host) leaves rank 0 to finish alone.
    # The loop commits every 5 steps (25, then the kill at 28: 3 rolled back); fit every 5 batches
    # of an epoch and at its end (24 steps an epoch: the kill at 28 is 4 after the commit at 24).
    kill_step, commit_every = 28, 5
    lines, out = run_example(tmp_path, script, ["localhost:1", "127.0.0.1:1"], 2, 1,
                             "--keras", keras, "--commit-every", str(commit_every),
                             watch_args=("--faults", f"1:{kill_step}:kill"))
    accuracy, workers = final_accuracy(lines)
    assert accuracy > MIN_ACCURACY, lines
    assert workers == 1, lines
    assert f"(Keras {keras}." in lines[-1], f"not the Keras asked for: {lines[-1]}"
    assert_killed_and_recovered(lines, out, kill_step, commit_every, survivors=1,
                                printed=script == "tensorflow_elastic.py", rolled_back=rolled_back)
    assert_exactly_once(out)

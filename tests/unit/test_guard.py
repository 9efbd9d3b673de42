"""The numeric guard: agreed verdicts on non-finite values and loss spikes, its window and limit."""

import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from elastic_ext.errors import ConfigError, ElasticExtError, RollbackLimitError
from elastic_ext.errors import NumericFaultError, NumericRollbackLimitError
from elastic_ext.policies.guard import (LOSS_SPIKE, NONFINITE_GRADIENT, NONFINITE_LOSS, FaultCounter, LossWindow,
                                        NumericGuard, Verdict)
from elastic_ext.policies.numeric_signal import GlobalSignal, LocalSignal, agree, reduce_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GatherTable:
    """A binding stand-in: every rank's allgather returns the same prepared table (what Horovod gives)."""

    def __init__(self, rows):
        self.table = np.concatenate([np.asarray(r, dtype=np.float64) for r in rows])
        self.calls = []

    def allgather(self, array, name):
        self.calls.append((array.copy(), name))
        return self.table.copy()


def noisy_losses(n, seed=0, level=2.0, noise=0.05):
    rng = random.Random(seed)
    return [level + rng.uniform(-noise, noise) for _ in range(n)]


def judge_all(guard, losses, window):
    """Feeds losses through check() as one rank would; returns the verdicts (faults included)."""
    verdicts = []
    for step, loss in enumerate(losses):
        try:
            verdicts.append(guard.check(step, GlobalSignal(loss=loss), window))
        except NumericFaultError as fault:
            verdicts.append(fault.verdict)
    return verdicts


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, quoted", [
    ({"window": 0}, "window (0)"),
    ({"window": 2.5}, "window (2.5)"),
    ({"window": True}, "window (True)"),
    ({"spike_k": 0}, "spike_k (0)"),
    ({"spike_k": -1.0}, "spike_k (-1.0)"),
    ({"spike_k": float("nan")}, "spike_k (nan)"),
    ({"spike_k": "3"}, "spike_k ('3')"),
])
def test_bad_parameters_are_refused_with_the_value_quoted(kwargs, quoted):
    with pytest.raises(ConfigError) as info:
        NumericGuard(**kwargs)
    assert quoted in str(info.value)


def test_defaults_and_edge_values_are_accepted():
    guard = NumericGuard()
    assert (guard.window, guard.min_history, guard.spike_k) == (100, 20, 10.0)
    assert NumericGuard(window=1, spike_k=None).spike_k is None and NumericGuard(window=8).min_history == 8
    assert guard.new_window().size == guard.window
    with pytest.raises(ConfigError, match=r"size \(0\)"):
        LossWindow(0)


# ---------------------------------------------------------------- agreement

def test_agree_allgathers_one_row_and_reduces_it_the_same_way_on_every_rank():
    rows = [LocalSignal(loss=1.0, samples=3, grad_sq=4.0).row(), LocalSignal(loss=3.0, samples=1, grad_sq=2.0).row()]
    signals = []
    for rank in range(2):
        binding = GatherTable(rows)
        signals.append(agree(binding, LocalSignal(loss=[1.0, 3.0][rank], samples=[3, 1][rank])))
        (sent, name), = binding.calls
        assert sent.shape == (1, 5) and sent.dtype == np.float64 and name == "elastic_ext.policies.guard"
    assert signals[0] == signals[1]
    assert signals[0].loss == pytest.approx((1.0 * 3 + 3.0 * 1) / 4)  # weighted by samples
    assert signals[0].grad_norm == pytest.approx(math.sqrt((4.0 + 2.0) / 2))
    assert signals[0].loss_finite and signals[0].grad_finite and signals[0].bad_ranks == ()


def test_a_row_from_a_framework_helper_is_accepted_and_a_bad_shape_refused():
    binding = GatherTable([LocalSignal(loss=2.0).row()])
    assert agree(binding, np.array([2.0, 1, 0, 0, 0])).loss == 2.0
    with pytest.raises(ValueError, match=r"5 numbers, got shape \(1, 4\)"):
        agree(binding, np.zeros(4))
    with pytest.raises(ValueError, match=r"\(3,\) must be"):
        reduce_rows(np.zeros(3))


def test_one_rank_with_a_nan_loss_makes_every_rank_see_a_nonfinite_loss_and_names_it():
    table = np.concatenate([LocalSignal(loss=1.0).row(), LocalSignal(loss=float("nan"), loss_finite=False).row(),
                            LocalSignal(loss=1.2).row()])
    signal = reduce_rows(table)
    assert not signal.loss_finite and signal.grad_finite and signal.bad_ranks == (1,)
    verdict = NumericGuard().judge(7, signal, noisy_losses(50))
    assert (verdict.reason, verdict.step, verdict.bad_ranks) == (NONFINITE_LOSS, 7, (1,))
    assert "non-finite loss on ranks [1]" in verdict.describe()


def test_an_infinite_gradient_on_one_rank_is_a_nonfinite_gradient_even_with_a_finite_loss():
    table = np.concatenate([LocalSignal(loss=1.0, grad_sq=1.0).row(),
                            LocalSignal(loss=1.0, grad_finite=False, grad_sq=float("inf")).row()])
    signal = reduce_rows(table)
    assert signal.loss_finite and not signal.grad_finite and signal.grad_norm is None
    verdict = NumericGuard().judge(3, signal, [])
    assert verdict.reason == NONFINITE_GRADIENT and verdict.bad_ranks == (1,)
    assert "non-finite gradient on ranks [1]" in verdict.describe()


def test_a_nan_squared_norm_counts_even_if_the_flag_was_not_set():
    signal = reduce_rows(np.array([[1.0, 1, 0, 0, float("nan")]]))
    assert not signal.grad_finite and signal.bad_ranks == (0,)


def test_nonfinite_loss_wins_over_nonfinite_gradient():
    signal = GlobalSignal(loss=float("inf"), loss_finite=False, grad_finite=False)
    assert NumericGuard().judge(0, signal, []).reason == NONFINITE_LOSS


def test_identical_inputs_give_identical_verdicts_on_every_rank():
    guard = NumericGuard(window=30, spike_k=6.0)
    losses = noisy_losses(60, seed=3) + [50.0] + noisy_losses(20, seed=4) + [float("nan")]
    ranks = [judge_all(guard, losses, guard.new_window()) for _ in range(4)]
    assert ranks[0] == ranks[1] == ranks[2] == ranks[3]
    reasons = [v.reason for v in ranks[0] if not v.ok]
    assert reasons == [LOSS_SPIKE, NONFINITE_LOSS]


# ------------------------------------------------------------------ spike rule

def test_a_spike_is_found_with_its_threshold_and_value_named():
    guard = NumericGuard(window=50, spike_k=10.0)
    history = noisy_losses(50, noise=0.05)
    verdict = guard.judge(120, GlobalSignal(loss=20.0), history)
    assert verdict.reason == LOSS_SPIKE
    median = float(np.median(history))
    assert verdict.median == pytest.approx(median)
    assert verdict.threshold == pytest.approx(median + 10.0 * verdict.scale)
    assert verdict.threshold < 20.0
    text = verdict.describe()
    assert "step 120" in text and "loss 20.0" in text and repr(verdict.threshold) in text
    accepted = guard.judge(121, GlobalSignal(loss=median + 0.05), history)
    assert accepted.ok and accepted.threshold == verdict.threshold


def test_the_rule_is_robust_to_outliers_already_in_the_window():
    # Three large losses got in (say before the guard's warm-up ended). A mean + k * std rule would
    # now tolerate almost anything; median + k * MAD barely moves.
    history = noisy_losses(47, seed=1) + [40.0, 60.0, 80.0]
    guard = NumericGuard(window=50, spike_k=10.0)
    threshold, median, scale = guard.threshold(history)
    mean, std = float(np.mean(history)), float(np.std(history))
    assert mean + 10.0 * std > 100.0
    assert threshold < 3.5 and median == pytest.approx(2.0, abs=0.05)
    assert guard.judge(0, GlobalSignal(loss=10.0), history).reason == LOSS_SPIKE


def test_no_spike_rule_before_min_history_losses():
    guard = NumericGuard(window=50, spike_k=3.0)
    window = guard.new_window()
    verdicts = judge_all(guard, noisy_losses(19) + [1000.0], window)
    assert all(v.ok and v.threshold is None for v in verdicts)
    assert len(window) == 20  # the early large loss was accepted: it is what training looked like then
    assert guard.judge(20, GlobalSignal(loss=float("nan"), loss_finite=False), []).reason == NONFINITE_LOSS


def test_spike_rule_off_keeps_the_nonfinite_checks():
    guard = NumericGuard(spike_k=None, window=10)
    history = [1.0] * 10
    assert guard.threshold(history) is None
    assert guard.judge(0, GlobalSignal(loss=1e6), history).ok
    assert guard.judge(0, GlobalSignal(loss=float("nan"), loss_finite=False), history).reason == NONFINITE_LOSS


def test_a_flat_window_does_not_call_noise_a_spike():
    guard = NumericGuard(window=20, spike_k=10.0)
    history = [1.0] * 20  # MAD is exactly 0: the MIN_SPREAD floor (5 % of the median) sets the scale
    assert guard.judge(0, GlobalSignal(loss=1.2), history).ok
    assert guard.judge(0, GlobalSignal(loss=2.0), history).reason == LOSS_SPIKE
    assert guard.judge(0, GlobalSignal(loss=0.0), [0.0] * 20).ok  # a flat 0: the threshold stays above it


def test_only_the_newest_window_losses_count():
    guard = NumericGuard(window=10, spike_k=5.0)
    history = [100.0] * 50 + [1.0] * 10  # the older, higher level has scrolled out
    assert guard.judge(0, GlobalSignal(loss=50.0), history).reason == LOSS_SPIKE


def test_a_falling_loss_is_never_a_spike():
    guard = NumericGuard(window=20, spike_k=6.0)
    losses = [5.0 * 0.97 ** i for i in range(200)]
    assert all(v.ok for v in judge_all(guard, losses, guard.new_window()))


# --------------------------------------------------------- check, window, limit

def test_check_raises_a_fault_signal_and_leaves_the_window_unchanged():
    guard = NumericGuard(window=20, spike_k=6.0)
    window = LossWindow(20, noisy_losses(20))
    before = window.state_dict()
    with pytest.raises(NumericFaultError) as info:
        guard.check(42, GlobalSignal(loss=30.0), window)
    fault = info.value
    assert isinstance(fault, ElasticExtError)
    assert (fault.step, fault.reason) == (42, LOSS_SPIKE) and fault.verdict.loss == 30.0
    assert "step 42" in str(fault) and "loss spike" in str(fault)
    assert window.state_dict() == before
    verdict = guard.check(43, GlobalSignal(loss=2.01), window)
    assert verdict.ok and window.losses[-1] == 2.01 and len(window) == 20


def test_verdict_fields_are_json_ready():
    import json
    verdict = Verdict(step=3, reason=NONFINITE_LOSS, loss=float("nan"), bad_ranks=(2,))
    fields = verdict.fields()
    assert fields["loss"] == "nan" and fields["bad_ranks"] == [2] and fields["reason"] == NONFINITE_LOSS
    json.dumps(fields, allow_nan=False)


def test_loss_window_round_trips_so_a_newcomer_judges_like_the_others():
    guard = NumericGuard(window=30, spike_k=6.0)
    old = guard.new_window()
    judge_all(guard, noisy_losses(45, seed=7), old)
    newcomer = LossWindow(1)
    newcomer.load_state_dict(old.state_dict())
    assert newcomer.losses == old.losses and newcomer.size == 30 and len(newcomer) == 30
    for loss in (2.0, 2.4, 9.0):
        assert guard.judge(5, GlobalSignal(loss=loss), newcomer.losses) == guard.judge(5, GlobalSignal(loss=loss),
                                                                                      old.losses)
    with pytest.raises(ValueError, match=r"loss \(inf\) must be finite"):
        old.accept(float("inf"))


def test_fault_counter_limits_numeric_rollbacks_in_a_row_without_a_new_commit():
    counter = FaultCounter(2)
    verdict = Verdict(step=9, reason=NONFINITE_LOSS, loss=float("nan"))
    assert counter.note(4, verdict) == 1
    assert counter.note(4, verdict) == 2
    with pytest.raises(NumericRollbackLimitError) as info:
        counter.note(4, verdict)
    assert isinstance(info.value, RollbackLimitError)
    assert "3 numeric rollbacks" in str(info.value) and "rollback_limit (2)" in str(info.value)
    assert "commit id 4" in str(info.value) and "step 9" in str(info.value)
    assert counter.note(5, verdict) == 1  # a new commit in between starts the count again


def test_zero_rollbacks_allowed_fails_at_the_first_fault():
    with pytest.raises(NumericRollbackLimitError, match=r"rollback_limit \(0\)"):
        FaultCounter(0).note(1, Verdict(step=1, reason=LOSS_SPIKE, loss=9.0))


# ----------------------------------------------------------- framework helpers

def test_torch_row_flags_nan_and_inf_and_measures_the_norm():
    import torch
    from elastic_ext.torch.guard import agree_step, local_row

    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(4, 3)).pow(2).mean()
    loss.backward()
    row = local_row(loss, model.parameters(), samples=4)
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert row.shape == (1, 5) and row[0, 1] == 4 and row[0, 2] == 0 and row[0, 3] == 0
    assert row[0, 0] == pytest.approx(float(loss.detach()))
    assert math.sqrt(row[0, 4]) == pytest.approx(expected, rel=1e-5)

    model.weight.grad[0, 0] = float("nan")
    bad = local_row(loss, model.parameters(), samples=4)
    assert bad[0, 2] == 0 and bad[0, 3] == 1
    nan_loss = local_row(torch.tensor(float("nan")), [torch.ones(2)], samples=1)
    assert nan_loss[0, 2] == 1 and nan_loss[0, 3] == 0
    half = local_row(1.0, [torch.full((4,), 60000.0, dtype=torch.float16), None], samples=1)
    assert half[0, 3] == 0 and math.sqrt(half[0, 4]) == pytest.approx(120000.0, rel=1e-3)  # no float16 overflow
    mixed = local_row(torch.tensor(1.0, dtype=torch.float64),
                      [torch.full((3,), 2.0, dtype=torch.float64), torch.full((1,), 4.0, dtype=torch.bfloat16)])
    assert mixed[0, 4] == pytest.approx(12.0 + 16.0)
    sparse = torch.sparse_coo_tensor([[0, 2]], [3.0, 4.0], (5,))
    assert local_row(0.5, [sparse])[0, 4] == pytest.approx(25.0)

    binding = GatherTable([local_row(loss, [torch.ones(2)], 4), nan_loss])
    signal = agree_step(loss, [torch.ones(2)], samples=4, binding=binding)
    assert not signal.loss_finite and signal.bad_ranks == (1,)


def test_tensorflow_row_flags_nan_and_inf_inside_tf_function():
    import tensorflow as tf
    from elastic_ext.tensorflow.guard import agree_step, local_row

    grads = [tf.constant([3.0, 4.0]), None, tf.IndexedSlices(tf.constant([[1.0, 2.0]]), tf.constant([0])),
             tf.constant([2.0], dtype=tf.float16)]
    row = local_row(tf.constant(0.5), grads, samples=8).numpy()
    assert row.shape == (1, 5) and row.dtype == np.float64
    assert row[0].tolist() == pytest.approx([0.5, 8, 0, 0, 9 + 16 + 1 + 4 + 4])

    @tf.function
    def compiled(loss, grad):
        return local_row(loss, [grad], samples=tf.constant(2))

    bad = compiled(tf.constant(float("nan")), tf.constant([1.0, float("inf")])).numpy()
    assert bad[0, 2] == 1 and bad[0, 3] == 1 and bad[0, 1] == 2

    binding = GatherTable([row, np.array([[1.5, 8, 0, 0, 50.0]])])
    signal = agree_step(tf.constant(0.5), grads, samples=8, binding=binding)
    assert signal.loss == pytest.approx(1.0) and signal.grad_finite
    assert signal.grad_norm == pytest.approx(math.sqrt((34 + 50) / 2))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_helpers_run_their_one_collective_through_real_horovod_in_a_world_of_one(framework):
    # In a subprocess: Horovod is initialised once per process.
    if framework == "torch":
        code = ("import torch, horovod.torch as hvd\n"
                "from elastic_ext.torch.guard import agree_step\n"
                "hvd.init()\n"
                "good = agree_step(torch.tensor(2.0), [torch.ones(4)], samples=3)\n"
                "bad = agree_step(torch.tensor(2.0), [torch.tensor([float('nan')])], samples=3)\n")
    else:
        code = ("import tensorflow as tf, horovod.tensorflow as hvd\n"
                "from elastic_ext.tensorflow.guard import agree_step\n"
                "hvd.init()\n"
                "good = agree_step(tf.constant(2.0), [tf.ones(4)], samples=3)\n"
                "bad = agree_step(tf.constant(2.0), [tf.constant([float('nan')])], samples=3)\n")
    code += ("assert (good.loss, good.grad_norm, good.loss_finite, good.grad_finite) == (2.0, 2.0, True, True), good\n"
             "assert not bad.grad_finite and bad.bad_ranks == (0,), bad\n"
             "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=REPO,
                            env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]

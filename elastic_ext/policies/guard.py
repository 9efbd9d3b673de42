"""Numeric faults (NaN/Inf, loss spikes) as agreed decisions: the framework-neutral core.

A bad batch or flaky hardware can leave a step with a non-finite loss or
gradient, or a loss far above its recent level, without any collective
failing. This module decides whether a step is such a *numeric fault*; the
``run`` decorator then treats it like a failed collective: every rank rolls
back to the last commit together and skips the offending step's samples.

Agreement without an extra vote: the decision is a pure function of values
every rank holds bit for bit: the step's :class:`GlobalSignal`, which
:func:`agree` builds from ONE small allgather (``Binding.allgather``) of each
rank's 5-number :class:`LocalSignal` row, reduced in rank order; and the
:class:`LossWindow` of accepted global losses, which is committed state
(restored on rollback, sent to newcomers by ``sync``). So
:meth:`NumericGuard.judge` returns the same :class:`Verdict` on every rank.
An allgather rather than a sum also says *which* ranks saw non-finite values.
The signal and its agreement are :mod:`elastic_ext.policies.numeric_signal`'s; this
module owns the rules, the verdict, the loss window and the rollback count.
``elastic_ext.torch.guard`` and ``elastic_ext.tensorflow.guard`` compute the
local row from a framework's loss and gradients.

The spike rule: after :data:`MIN_HISTORY` accepted steps (or a full window),
a finite loss is a spike when ``loss > median + spike_k * scale`` over the
last ``window`` accepted losses, ``scale = max(1.4826 * MAD, MIN_SPREAD *
|median|)``. The
median absolute deviation (MAD) ignores a few outliers (unlike a standard
deviation), 1.4826 makes ``spike_k`` read as standard deviations for
Gaussian noise, and the :data:`MIN_SPREAD` floor keeps a flat window (MAD near
0) from calling every wiggle a spike.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Deque, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from elastic_ext.errors import ConfigError, NumericFaultError, NumericRollbackLimitError
from elastic_ext.policies.numeric_signal import GlobalSignal

__all__ = ["LOSS_SPIKE", "MAD_TO_SIGMA", "MIN_HISTORY", "MIN_SPREAD", "NONFINITE_GRADIENT", "NONFINITE_LOSS", "REASONS", "FaultCounter",
           "LossWindow", "NumericGuard", "Verdict"]

NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRADIENT = "nonfinite_gradient"
LOSS_SPIKE = "loss_spike"
REASONS = (NONFINITE_LOSS, NONFINITE_GRADIENT, LOSS_SPIKE)

#: Makes the MAD a consistent estimator of the standard deviation for Gaussian noise.
MAD_TO_SIGMA = 1.4826
#: Keeps the threshold above the median when the window is exactly flat at 0.
_ABS_FLOOR = 1e-12


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The guard's decision on one step; equal on every rank for equal inputs.

    ``reason`` is None for a good step. ``threshold`` is the spike threshold
    in force (None before ``min_history`` losses), ``median`` and ``scale``
    the robust statistics it came from.
    """

    step: int
    reason: Optional[str]
    loss: float
    threshold: Optional[float] = None
    median: Optional[float] = None
    scale: Optional[float] = None
    grad_norm: Optional[float] = None
    bad_ranks: Tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        if self.reason is None:
            return f"step {self.step}: loss {self.loss!r} accepted"
        if self.reason == LOSS_SPIKE:
            return (f"step {self.step}: loss spike: loss {self.loss!r} > threshold {self.threshold!r} "
                    f"(median {self.median!r} + k x scale {self.scale!r})")
        ranks = f" on ranks {list(self.bad_ranks)}" if self.bad_ranks else ""
        what = "loss" if self.reason == NONFINITE_LOSS else "gradient"
        return f"step {self.step}: non-finite {what}{ranks} (loss {self.loss!r}, grad norm {self.grad_norm!r})"

    def fields(self) -> dict:
        """JSON-compatible fields for an event (non-finite floats as text)."""
        out = dataclasses.asdict(self)
        out["bad_ranks"] = list(self.bad_ranks)
        return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def _positive_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} ({value!r}) must be an integer >= {low}")


def _finite_number(name: str, value: Any, low: float, strict: bool) -> None:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < low or (strict and value == low):
        raise ConfigError(f"{name} ({value!r}) must be a finite number {'>' if strict else '>='} {low}")


#: The spike rule waits for this many accepted losses (or a full window, if smaller): the first steps
#: of training move fast, and a median and MAD of fewer losses are not robust yet.
MIN_HISTORY = 20
#: Floor of the spike rule's ``scale`` relative to ``|median|``: a nearly flat window (MAD near 0)
#: does not flag ordinary noise.
MIN_SPREAD = 0.05


@dataclasses.dataclass(frozen=True)
class NumericGuard:
    """Rules of the numeric guard (opt-in; validated at construction).

    Attributes:
        window: how many accepted global losses the spike rule looks back on.
        spike_k: a loss above ``median + spike_k * scale`` of the window is a
            spike; None turns the spike rule off (non-finite checks remain).

    Numeric rollbacks in a row without a new commit are limited by
    ``ElasticConfig.rollback_limit`` (counted apart from failed collectives).

    Raises:
        ConfigError: a value is out of range; the message quotes it.
    """

    window: int = 100
    spike_k: Optional[float] = 10.0

    def __post_init__(self) -> None:
        _positive_int("window", self.window, 1)
        if self.spike_k is not None:
            _finite_number("spike_k", self.spike_k, 0.0, strict=True)

    @property
    def min_history(self) -> int:
        """Accepted losses the spike rule waits for: :data:`MIN_HISTORY`, or the whole window if smaller."""
        return min(self.window, MIN_HISTORY)

    def threshold(self, history: Sequence[float]) -> Optional[Tuple[float, float, float]]:
        """``(threshold, median, scale)`` over the newest ``window`` losses, or None if the rule is off."""
        if self.spike_k is None or len(history) < self.min_history:
            return None
        recent = sorted(float(x) for x in list(history)[-self.window:])
        median = _median(recent)
        mad = _median(sorted(abs(x - median) for x in recent))
        scale = max(MAD_TO_SIGMA * mad, MIN_SPREAD * abs(median), _ABS_FLOOR)
        return median + self.spike_k * scale, median, scale

    def judge(self, step: int, signal: GlobalSignal, history: Sequence[float]) -> Verdict:
        """Decides on one step from agreed values only: a pure function.

        Order of the rules: non-finite loss, non-finite gradient, spike.
        """
        base = dict(step=int(step), loss=float(signal.loss), grad_norm=signal.grad_norm,
                    bad_ranks=tuple(signal.bad_ranks))
        if not signal.loss_finite or not math.isfinite(signal.loss):
            return Verdict(reason=NONFINITE_LOSS, **base)
        if not signal.grad_finite:
            return Verdict(reason=NONFINITE_GRADIENT, **base)
        rule = self.threshold(history)
        if rule is None:
            return Verdict(reason=None, **base)
        threshold, median, scale = rule
        reason = LOSS_SPIKE if signal.loss > threshold else None
        return Verdict(reason=reason, threshold=threshold, median=median, scale=scale, **base)

    def check(self, step: int, signal: GlobalSignal, window: "LossWindow") -> Verdict:
        """Judges the step; a good step's loss joins ``window``, a bad one raises.

        Raises:
            NumericFaultError: the verdict names a fault (the window is unchanged).
        """
        verdict = self.judge(step, signal, window.losses)
        if not verdict.ok:
            raise NumericFaultError(verdict)
        window.accept(verdict.loss)
        return verdict

    def new_window(self) -> "LossWindow":
        """An empty :class:`LossWindow` of this guard's ``window`` size."""
        return LossWindow(self.window)


def _median(ordered: Sequence[float]) -> float:
    n = len(ordered)
    middle = n // 2
    return ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2.0


class LossWindow:
    """The accepted global losses the spike rule looks back on: committed state.

    Track it in the ``State`` (it has ``state_dict``/``load_state_dict`` over
    plain values): a rollback restores it with the weights, and ``sync`` gives
    newcomers the same window, so every rank judges from the same history.
    """

    def __init__(self, size: int = 100, losses: Iterable[float] = ()) -> None:
        _positive_int("size", size, 1)
        self._losses: Deque[float] = collections.deque((float(x) for x in losses), maxlen=int(size))

    @property
    def size(self) -> int:
        return int(self._losses.maxlen or 0)

    @property
    def losses(self) -> List[float]:
        return list(self._losses)

    def accept(self, loss: float) -> None:
        """Adds an accepted step's loss (finite: a fault never enters the window).

        Raises:
            ValueError: ``loss`` is NaN or infinite.
        """
        if not math.isfinite(loss):
            raise ValueError(f"loss ({loss!r}) must be finite to enter the window")
        self._losses.append(float(loss))

    def __len__(self) -> int:
        return len(self._losses)

    def state_dict(self) -> dict:
        return {"size": self.size, "losses": list(self._losses)}

    def load_state_dict(self, state: dict) -> None:
        self._losses = collections.deque((float(x) for x in state["losses"]), maxlen=int(state["size"]))


class FaultCounter:
    """Counts numeric rollbacks in a row without a new commit (kept outside the committed state,
    which a rollback would reset).

    Args:
        limit: numeric rollbacks allowed in a row (``ElasticConfig.rollback_limit``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._commit_id: Optional[int] = None
        self.count = 0

    def note(self, commit_id: int, verdict: Verdict) -> int:
        """Counts one numeric rollback back to ``commit_id``; returns the count in a row.

        Raises:
            NumericRollbackLimitError: the count exceeds ``limit``.
        """
        if commit_id == self._commit_id:
            self.count += 1
        else:
            self._commit_id, self.count = commit_id, 1
        if self.count > self.limit:
            raise NumericRollbackLimitError(
                f"{self.count} numeric rollbacks in a row without a new commit (commit id {commit_id}) exceed "
                f"rollback_limit ({self.limit}); last: {verdict.describe()}")
        return self.count

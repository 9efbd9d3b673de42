"""A step's numeric signal and its agreement across ranks, for the numeric guard.

Owns what one rank saw in a step (:class:`LocalSignal`, a 5-number float64
row), the ONE small allgather that shares those rows (:func:`agree`, over
``Binding.allgather``) and their reduction in rank order into the
:class:`GlobalSignal` that every rank then holds bit for bit
(:func:`reduce_rows`). An allgather rather than a sum allreduce also says
*which* ranks saw non-finite values. :mod:`elastic_ext.policies.guard` judges the
agreed signal and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional, Tuple, Union

import numpy as np


#: Columns of a local signal row (see :class:`LocalSignal`).
SIGNAL_WIDTH = 5


@dataclasses.dataclass(frozen=True)
class LocalSignal:
    """What one rank saw in one step, before agreement.

    Attributes:
        loss: this rank's mean loss over its samples (may be NaN/Inf).
        samples: how many samples the loss averages (weights the global mean).
        loss_finite: False if the loss is NaN or infinite.
        grad_finite: False if any gradient element is NaN or infinite (a
            float32 norm that overflows counts as non-finite).
        grad_sq: squared L2 norm of this rank's gradients (0 if not measured).
    """

    loss: float
    samples: int = 1
    loss_finite: bool = True
    grad_finite: bool = True
    grad_sq: float = 0.0

    def row(self) -> np.ndarray:
        """The float64 row of 5 numbers that :func:`agree` allgathers."""
        return np.array([[self.loss, self.samples, 0.0 if self.loss_finite else 1.0,
                          0.0 if self.grad_finite else 1.0, self.grad_sq]], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class GlobalSignal:
    """A step's numeric signal as every rank holds it after :func:`agree` (identical bits).

    Attributes:
        loss: sample-weighted mean of the ranks' losses.
        loss_finite: every rank's loss was finite.
        grad_finite: every rank's gradients were finite.
        grad_norm: ``sqrt(sum of the ranks' squared norms / ranks)``: the norm
            of the averaged gradient when each rank measured it after the
            gradient allreduce, the RMS of the ranks' own norms before it.
        bad_ranks: ranks that reported a non-finite loss, or, when every
            loss is finite, ranks that reported a non-finite gradient. A NaN
            loss on one rank reaches every rank's gradients through the
            allreduce; this still names only the rank where it began.
    """

    loss: float
    loss_finite: bool = True
    grad_finite: bool = True
    grad_norm: Optional[float] = None
    bad_ranks: Tuple[int, ...] = ()


def reduce_rows(table: np.ndarray) -> GlobalSignal:
    """Reduces the allgathered ``(ranks, 5)`` table in rank order (the same arithmetic on every rank).

    Raises:
        ValueError: the table is not ``(ranks >= 1, 5)``.
    """
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] != SIGNAL_WIDTH:
        raise ValueError(f"signal table shape {table.shape} must be (ranks >= 1, {SIGNAL_WIDTH})")
    weighted = samples = grad_sq = 0.0
    bad_loss: List[int] = []
    bad_grad: List[int] = []
    loss_finite = grad_finite = True
    for rank, (loss, count, loss_bad, grad_bad, sq) in enumerate(table.tolist()):
        loss_ok = loss_bad == 0.0 and math.isfinite(loss)
        grad_ok = grad_bad == 0.0 and math.isfinite(sq)
        loss_finite &= loss_ok
        grad_finite &= grad_ok
        if not loss_ok:
            bad_loss.append(rank)
        if not grad_ok:
            bad_grad.append(rank)
        weighted += loss * count
        samples += count
        grad_sq += sq
    mean = weighted / samples if samples > 0 and loss_finite else float("nan")
    norm = math.sqrt(grad_sq / table.shape[0]) if grad_finite else None
    return GlobalSignal(loss=mean, loss_finite=loss_finite and math.isfinite(mean), grad_finite=grad_finite,
                        grad_norm=norm, bad_ranks=tuple(bad_loss or bad_grad))


def agree(binding: Any, local: Union[LocalSignal, np.ndarray], name: str = "elastic_ext.policies.guard") -> GlobalSignal:
    """The one collective of the guard: allgathers every rank's row, reduces it locally.

    ``binding`` is an :class:`elastic_ext.binding.Binding` (its ``allgather``
    over a ``(1, 5)`` float64 array); ``local`` a :class:`LocalSignal` or its
    row (what a framework helper computed on the device).

    Raises:
        ValueError: ``local`` is a row of the wrong shape.
        HorovodInternalError: the collective failed (a peer is gone).
    """
    row = local.row() if isinstance(local, LocalSignal) else np.asarray(local, dtype=np.float64).reshape(1, -1)
    if row.shape != (1, SIGNAL_WIDTH):
        raise ValueError(f"a local signal row must hold {SIGNAL_WIDTH} numbers, got shape {row.shape}")
    return reduce_rows(binding.allgather(row, name))

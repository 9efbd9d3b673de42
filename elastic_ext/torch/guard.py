"""The numeric guard's local signal for PyTorch: loss, finiteness and gradient norm.

:func:`local_row` reduces a step's loss and gradients to the 5 numbers of
:class:`elastic_ext.policies.numeric_signal.LocalSignal` on the gradients' device (one fused
norm per tensor, no per-element host work) and copies them to the host once.
``state.guard_step`` allgathers that ``(1, 5)`` row in Horovod's background
thread (:meth:`elastic_ext.torch.binding.TorchBinding.allgather_start`) and
judges the step at the next ``guard_step`` or ``commit()``
(:mod:`elastic_ext.policies.numeric_rollback`); :func:`agree_step` is the
blocking form, for a loop that judges by itself.

Call it after the gradient allreduce (``optimizer.synchronize()`` of
Horovod's ``DistributedOptimizer``) and before ``optimizer.step()`` (under
``optimizer.skip_synchronize()``) to see the averaged gradients and keep a
bad step out of the weights; before the allreduce it sees this rank's own
gradients, which is enough to tell which rank's batch went bad.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import numpy as np
import torch

from elastic_ext.policies.numeric_signal import GlobalSignal, LocalSignal, agree

# Half-precision norms are taken in float32 (a float16 sum of squares overflows at 256);
# float32 and float64 gradients keep their own precision (vector_norm refuses to narrow).
_NORM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

Gradients = Iterable[Union[torch.Tensor, torch.nn.Parameter, None]]


def _gradient_tensors(grads: Gradients) -> list:
    """Gradient tensors from tensors or parameters (a parameter stands for its ``.grad``; None skipped)."""
    tensors = []
    for item in grads:
        if isinstance(item, torch.nn.Parameter):
            item = item.grad
        if item is None:
            continue
        item = item.detach()
        if item.is_sparse:
            item = item.coalesce().values()
        tensors.append(item)
    return tensors


def local_row(loss: Union[torch.Tensor, float], grads: Gradients = (), samples: int = 1) -> np.ndarray:
    """This rank's ``(1, 5)`` float64 row: loss, samples, loss bad, gradient bad, squared gradient norm.

    Norms are taken per tensor in the gradient's precision (float32 for
    half-precision gradients), so a norm that overflows counts as a
    non-finite gradient.
    """
    tensors = _gradient_tensors(grads)
    if isinstance(loss, torch.Tensor):
        loss_t = loss.detach().reshape(-1)[:1].double()
        device = tensors[0].device if tensors else loss_t.device
        parts = [loss_t.to(device)]
    else:
        device = tensors[0].device if tensors else torch.device("cpu")
        parts = [torch.tensor([float(loss)], dtype=torch.float64, device=device)]
    if tensors:
        norms = torch.stack([torch.linalg.vector_norm(t, dtype=_NORM_DTYPE.get(t.dtype)).double() for t in tensors])
        parts.append(torch.linalg.vector_norm(norms).reshape(1))
    loss_value, *norm = torch.cat(parts).cpu().tolist()  # the one device-to-host copy
    norm_value = norm[0] if norm else 0.0
    grad_sq = norm_value * norm_value
    return LocalSignal(loss=loss_value, samples=int(samples), loss_finite=math.isfinite(loss_value),
                       grad_finite=math.isfinite(grad_sq), grad_sq=grad_sq).row()


def agree_step(loss: Union[torch.Tensor, float], grads: Gradients = (), samples: int = 1,
               binding: Optional[Any] = None) -> GlobalSignal:
    """The step's :class:`~elastic_ext.policies.numeric_signal.GlobalSignal`, identical on every rank (one allgather).

    Raises:
        HorovodInternalError: the allgather failed (a peer is gone).
    """
    if binding is None:
        from elastic_ext.torch.binding import TorchBinding
        binding = TorchBinding()
    return agree(binding, local_row(loss, grads, samples))

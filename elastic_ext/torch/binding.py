"""Horovod operations for PyTorch, over host numpy arrays."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

import horovod.torch as hvd

from elastic_ext.binding import HorovodBasics, register_binding


def _tensor(array: np.ndarray) -> torch.Tensor:
    # torch.from_numpy needs a writable, contiguous array; collectives read it.
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, copy=True, order="C")
    return torch.from_numpy(array)


class TorchBinding(HorovodBasics):
    """:class:`elastic_ext.binding.Binding` for ``horovod.torch``."""

    framework = "torch"
    hvd = hvd

    def broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return hvd.broadcast(_tensor(array), root_rank, name=name).numpy()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(_tensor(array), name=name).numpy()

    def allreduce_max(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allreduce(_tensor(array), name=name, op=hvd.Max).numpy()

    def allreduce_max_start(self, array: np.ndarray, name: str) -> Callable[[], np.ndarray]:
        """Starts :meth:`allreduce_max` in Horovod's background thread; the returned call waits for it."""
        handle = hvd.allreduce_async(_tensor(array), name=name, op=hvd.Max)
        return lambda: hvd.synchronize(handle).numpy()

    def allgather_start(self, array: np.ndarray, name: str) -> Callable[[], np.ndarray]:
        """Starts :meth:`allgather` in Horovod's background thread; the returned call waits for it."""
        handle = hvd.allgather_async(_tensor(array), name=name)
        return lambda: hvd.synchronize(handle).numpy()

    def as_internal_error(self, exc: BaseException) -> Optional[BaseException]:
        # horovod.torch raises HorovodInternalError itself.
        return None


register_binding("torch", TorchBinding)

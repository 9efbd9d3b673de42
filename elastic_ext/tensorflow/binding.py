"""Horovod operations for TensorFlow, over host numpy arrays."""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.common.exceptions import HorovodInternalError

from elastic_ext.binding import HorovodBasics, register_binding

# Op names Horovod gives its TF kernels; an error from one of them means a
# collective failed (a peer died, Horovod was shut down under it).
_HOROVOD_OP = re.compile(r"Horovod(Allreduce|GroupedAllreduce|Allgather|GroupedAllgather|Broadcast|Alltoall|"
                         r"Reducescatter|GroupedReducescatter|Join|Barrier)")


_SHUT_DOWN = "Horovod has been shut down"


class TensorFlowBinding(HorovodBasics):
    """:class:`elastic_ext.binding.Binding` for ``horovod.tensorflow``."""

    framework = "tensorflow"
    hvd = hvd

    def _collective(self, collective, *args, **kwargs) -> np.ndarray:
        # sync() and commit() run these outside the training function too:
        # a failed Horovod op must surface as HorovodInternalError there as
        # well, so that @elastic_ext.run rolls back instead of crashing.
        try:
            return collective(*args, **kwargs).numpy()
        except tf.errors.OpError as exc:
            translated = self.as_internal_error(exc)
            if translated is None:
                raise
            raise translated from exc

    def broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return self._collective(hvd.broadcast, tf.constant(array), root_rank, name=name.replace(".", "_"))

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return self._collective(hvd.allgather, tf.constant(array), name=name.replace(".", "_"))

    def allreduce_max(self, array: np.ndarray, name: str) -> np.ndarray:
        return self._collective(hvd.allreduce, tf.constant(array), name=name.replace(".", "_"), op=hvd.Max)

    def as_internal_error(self, exc: BaseException) -> Optional[BaseException]:
        # Inside @tf.function the message names the graph node (the op's
        # name= argument, e.g. "grad_5"), not the op type: Horovod's own
        # shutdown text identifies those.
        if isinstance(exc, tf.errors.OpError) and (_HOROVOD_OP.search(str(exc)) or _SHUT_DOWN in str(exc)):
            return HorovodInternalError(str(exc))
        return None


register_binding("tensorflow", TensorFlowBinding)

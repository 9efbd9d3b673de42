"""The TF binding's error translation: Horovod op failures become HorovodInternalError, nothing else."""

import pytest
import tensorflow as tf
from horovod.common.exceptions import HorovodInternalError

from elastic_ext.tensorflow.binding import TensorFlowBinding


def test_horovod_op_errors_are_internal_errors_and_others_are_not():
    binding = TensorFlowBinding()
    failed = tf.errors.UnknownError(None, None, "HorovodAllreduce_grad_0_0 failed: Horovod has been shut down")
    assert isinstance(binding.as_internal_error(failed), HorovodInternalError)
    not_ours = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]")
    assert binding.as_internal_error(not_ours) is None
    assert binding.as_internal_error(ValueError("HorovodAllreduce in a message")) is None


def test_collective_wrapper_translates_failures():
    binding = TensorFlowBinding()

    def failing(*args, **kwargs):
        raise tf.errors.UnknownError(None, None, "HorovodBroadcast_elastic_ext_sync_meta_len_0 failed")

    with pytest.raises(HorovodInternalError, match="HorovodBroadcast"):
        binding._collective(failing)

"""The TF binding's error translation: Horovod op failures become HorovodInternalError, nothing else."""

import os
import subprocess
import sys

import pytest
from horovod.common.exceptions import HorovodInternalError


@pytest.fixture(scope="module")
def tf():
    """TensorFlow, imported by the tests that use it: each pytest-xdist worker collects every module."""
    import tensorflow
    return tensorflow


@pytest.fixture
def binding(tf):
    from elastic_ext.tensorflow.binding import TensorFlowBinding
    return TensorFlowBinding()


def test_horovod_op_errors_are_internal_errors_and_others_are_not(tf, binding):
    failed = tf.errors.UnknownError(None, None, "HorovodAllreduce_grad_0_0 failed: Horovod has been shut down")
    assert isinstance(binding.as_internal_error(failed), HorovodInternalError)
    not_ours = tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]")
    assert binding.as_internal_error(not_ours) is None
    assert binding.as_internal_error(ValueError("HorovodAllreduce in a message")) is None


def test_collective_wrapper_translates_failures(tf, binding):
    def failing(*args, **kwargs):
        raise tf.errors.UnknownError(None, None, "HorovodBroadcast_elastic_ext_sync_meta_len_0 failed")

    with pytest.raises(HorovodInternalError, match="HorovodBroadcast"):
        binding._collective(failing)


def test_every_collective_runs_through_real_horovod_in_a_world_of_one():
    # In a subprocess: Horovod is initialised once per process.
    code = (
        "import numpy as np, horovod.tensorflow as hvd\n"
        "from elastic_ext.tensorflow.binding import TensorFlowBinding\n"
        "hvd.init(); b = TensorFlowBinding()\n"
        "a = np.array([3, 1, 2], dtype=np.int64)\n"
        "assert b.allreduce_max(a, 'x.max').tolist() == [3, 1, 2]\n"
        "assert b.allgather(a[None, :], 'x.gather').tolist() == [[3, 1, 2]]\n"
        "assert b.broadcast(np.arange(4, dtype=np.uint8), 0, 'x.bcast').tolist() == [0, 1, 2, 3]\n"
        "assert (b.rank(), b.size()) == (0, 1)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_a_step_traced_again_with_the_project_s_tape_creates_no_variable_in_the_trace():
    # Horovod's own TF2 elastic script: the step runs once without the allreduce to build the Keras
    # optimizer's slots, then the State is made, then the same tf.function runs with it: a second trace,
    # where a tf.function may create no variable. The gradient reduction's variables (its straggler
    # timing, the guard's signal) must exist before that: the State's binding creates them eagerly.
    code = (
        "import os\n"
        "os.environ.pop('TF_USE_LEGACY_KERAS', None)\n"
        "import numpy as np, tensorflow as tf, keras, horovod.tensorflow as hvd, elastic_ext\n"
        "from elastic_ext.tensorflow import DistributedGradientTape\n"
        "hvd.init()\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
        "schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)\n"
        "opt = keras.optimizers.Adam(schedule)\n"
        "@tf.function\n"
        "def step(x, y, allreduce=True):\n"
        "    with tf.GradientTape() as tape:\n"
        "        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))\n"
        "    if allreduce:\n"
        "        tape = DistributedGradientTape(tape)\n"
        "    grads = tape.gradient(loss, model.trainable_variables)\n"
        "    opt.apply_gradients(zip(grads, model.trainable_variables))\n"
        "    return loss\n"
        "x, y = tf.ones((2, 4)), tf.zeros((2, 3))\n"
        "step(x, y, allreduce=False)\n"
        "state = elastic_ext.State(model=model, optimizer=opt, batch=0)\n"
        "step(x, y)\n"
        "step(tf.ones((5, 4)), tf.zeros((5, 3)))  # another shape: traced once more\n"
        "print('ok', int(opt.iterations.numpy()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok 3"), result.stderr[-3000:]

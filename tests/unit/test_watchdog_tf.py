"""The stall check must see a rank waiting inside ``@tf.function`` as "in a
collective": Horovod's allreduce is then a graph node and no Python frame of
Horovod is on the main thread's stack (a waiting Keras rank was killed for it)."""

import time

from tests.unit.test_watchdog import sample_while


def test_a_main_thread_inside_a_tf_function_counts_as_possibly_in_a_collective():
    import tensorflow as tf  # here: each pytest-xdist worker collects every module, and few run this one

    def slow(x):
        time.sleep(0.6)  # stands in for an allreduce that waits for a slow peer
        return x

    @tf.function
    def step(x):
        return tf.py_function(slow, [x], tf.float32) * 2.0

    step(tf.constant(1.0))  # trace first, so the sampled call is pure graph execution
    seen = sample_while(lambda: step(tf.constant(1.0)))
    assert seen and sum(seen) >= len(seen) // 2, seen


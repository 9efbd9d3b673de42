"""The stall check must see a rank waiting inside ``@tf.function`` as "in a
collective": Horovod's allreduce is then a graph node and no Python frame of
Horovod is on the main thread's stack (a waiting Keras rank was killed for it)."""

import threading
import time

import tensorflow as tf

from elastic_ext.runtime import watchdog


def sample_while(main_work):
    """Runs ``main_work`` on the main thread while another thread samples the verdict."""
    seen = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(watchdog._main_thread_in_horovod())
            time.sleep(0.02)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        main_work()
    finally:
        stop.set()
        thread.join()
    return seen


def test_a_main_thread_inside_a_tf_function_counts_as_possibly_in_a_collective():
    def slow(x):
        time.sleep(0.6)  # stands in for an allreduce that waits for a slow peer
        return x

    @tf.function
    def step(x):
        return tf.py_function(slow, [x], tf.float32) * 2.0

    step(tf.constant(1.0))  # trace first, so the sampled call is pure graph execution
    seen = sample_while(lambda: step(tf.constant(1.0)))
    assert seen and sum(seen) >= len(seen) // 2, seen


def test_a_main_thread_in_plain_python_does_not():
    seen = sample_while(lambda: time.sleep(0.4))
    assert seen and not any(seen), seen

"""A ``tf.data`` source driven by the elastic cursor."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from elastic_ext.data import partition
from elastic_ext.data import permutation
from elastic_ext.data.sampler import ElasticPartitioner


class ElasticSampler(ElasticPartitioner):
    """:class:`ElasticPartitioner` whose world is ``horovod.tensorflow``'s."""

    def __init__(self, size: int, **kwargs: Any) -> None:
        if kwargs.get("world") is None:
            import horovod.tensorflow as hvd
            kwargs["world"] = lambda: (hvd.rank(), hvd.size())
        super().__init__(size, **kwargs)


def index_dataset(sampler: ElasticPartitioner) -> tf.data.Dataset:
    """One element per step: ``(indices int64[n], is_pad bool[n])`` for this rank.

    The plan is made when iteration starts, from the sampler's cursor and the
    world size at that moment; make a new iterator after every reset (the
    ``@elastic_ext.run`` function does so naturally when it is called again).
    Map it to data with ``tf.gather``; call ``sampler.record_step()`` after
    each step.
    """
    def generate():
        for indices, pad in sampler.batches():
            yield indices.astype("int64"), pad

    return tf.data.Dataset.from_generator(
        generate, output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool)))


def plan_at(sampler: ElasticPartitioner, epoch: int, cursor: int) -> partition.Plan:
    """This rank's steps of ``epoch`` from ``cursor``, at the current world size.

    Unlike :meth:`ElasticPartitioner.plan` this does not read or move the
    sampler's own position, so a stream can plan the epochs after the current
    one ahead of time.
    """
    rank, size = sampler.world()
    # Not sampler.order(): its cache follows the sampler's epoch, which the
    # training thread moves while a tf.data thread plans ahead.
    order = permutation.epoch_order(sampler.size, sampler.seed, epoch, sampler.shuffle)
    return partition.plan(order, cursor, sampler.global_batch, size, rank, sampler.policy)


def steps_in_epoch(sampler: ElasticPartitioner, cursor: int = 0) -> int:
    """Global steps from ``cursor`` to the end of an epoch, at the current world size."""
    return partition.steps_left(sampler.size, cursor, sampler.global_batch, sampler.policy)

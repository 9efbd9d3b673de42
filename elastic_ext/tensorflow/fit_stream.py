"""The data side of ``ElasticCallback.fit``: the steps ``model.fit`` is fed.

Owns :class:`FitStep` (one global step: where it starts in the epoch and
this rank's indices and padding) and :class:`StepStream`, the ``tf.data``
source of the steps from the committed position on, which remembers the
steps it handed out so that the callback
(:mod:`elastic_ext.tensorflow.callbacks`) can check each one against the
batch Keras trained on. The plans come from the sampler
(:func:`elastic_ext.tensorflow.data.plan_at`), past the ranges on its skip
list (the samples of steps the numeric guard rejected); nothing here commits
or touches the State.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Deque

import numpy as np
import tensorflow as tf

from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.tensorflow.data import plan_at


@dataclasses.dataclass(frozen=True)
class FitStep:
    """One global step as fed to ``model.fit``: where it starts and this rank's share."""

    epoch: int
    cursor: int
    indices: np.ndarray
    pad: np.ndarray


class StepStream:
    """The steps from a start position to the end of ``end_epoch - 1``, as a tf.data source.

    Every iterator Keras makes runs the generator again from the start
    position (Keras 3 takes one batch from a throw-away iterator to build the
    model); the steps the newest iterator handed out wait in ``handed_out``
    until the callback pairs them with the batches Keras trained on.
    """

    def __init__(self, sampler: ElasticPartitioner, epoch: int, cursor: int, end_epoch: int) -> None:
        self.sampler = sampler
        self.start = (epoch, cursor)
        self.end_epoch = end_epoch
        self.handed_out: Deque[FitStep] = collections.deque()
        # The skip list as committed (a numeric rollback's bad steps), read here: a tf.data thread plans.
        self.skipped = {(int(e), int(a)): int(b) for e, a, b in sampler.skipped}

    def generate(self):
        handed_out: Deque[FitStep] = collections.deque()
        self.handed_out = handed_out
        epoch, cursor = self.start
        while epoch < self.end_epoch:
            cursor = self._past_skips(epoch, cursor)
            plan = plan_at(self.sampler, epoch, cursor)
            advance = plan.advance
            for step, (indices, pad) in enumerate(plan.batches()):
                handed_out.append(FitStep(epoch, cursor, np.array(indices), np.array(pad, dtype=bool)))
                yield np.asarray(indices, dtype=np.int64), np.asarray(pad, dtype=bool)
                cursor += int(advance[step])
                if (epoch, cursor) in self.skipped:
                    break  # a skipped range starts here: plan again past it
            else:
                epoch, cursor = epoch + 1, 0

    def _past_skips(self, epoch: int, cursor: int) -> int:
        while (epoch, cursor) in self.skipped:
            cursor = self.skipped[(epoch, cursor)]
        return cursor

    def dataset(self, load: Callable[[tf.Tensor, tf.Tensor], Any]) -> tf.data.Dataset:
        """``load(indices, pad)`` of every step, as the dataset ``model.fit`` trains on."""
        source = tf.data.Dataset.from_generator(
            self.generate, output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool)))
        return source.map(load)


__all__ = ["FitStep", "StepStream"]

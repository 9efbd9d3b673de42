"""``model.fit`` made elastic: a Keras callback that commits, and fit calls that resume.

Keras 2 (tf_keras) and Keras 3::

    model.compile(optimizer=elastic_ext.tensorflow.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=...)
    sampler = elastic_ext.tensorflow.ElasticSampler(len(y), global_batch_size=64, policy="pad")
    state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0)
    elastic = elastic_ext.tensorflow.ElasticCallback(
        state, load=lambda idx, pad: (tf.gather(x, idx), tf.gather(y, idx), 1.0 - tf.cast(pad, tf.float32)),
        commit_every=10)

    @elastic_ext.run
    def train(state):
        return elastic.fit(model, epochs=10, callbacks=[tensorboard], verbose=0)

How it works. The committed state holds the epoch, the batch within the
epoch and the sampler's cursor. :meth:`ElasticCallback.fit` calls
``model.fit`` from there: an epoch begun (or with skipped steps) is finished
by a call of its own, then one call runs the remaining epochs with the steps
of a full epoch *at the current world size* (the global batch is constant).
The data is a ``tf.data`` stream of ``load(indices, pad)`` over this rank's
share of each global step from the committed cursor on
(:mod:`elastic_ext.tensorflow.fit_stream`), so the samples of rolled-back
steps are handed out again, once.

At the end of every batch the callback checks that the batch Keras trained
on is the one at the committed cursor (else ``StateError``), advances the
cursor and the counters, and commits every ``commit_every`` batches, and at
every epoch's end. A ``HostsUpdatedInterrupt`` from a commit and a failed
collective leave ``model.fit`` as exceptions.

Soft failures. With ``State(guard=NumericGuard(), step=0)`` each batch's
loss rides on its gradient allreduce (:mod:`elastic_ext.tensorflow.guard`);
a bad batch raises ``NumericFaultError`` at its end, before any commit, and
the fit call after the rollback leaves its samples out. Each batch's own
compute (until its gradients were ready) goes to ``state.step_timer``.

Order with other callbacks: :meth:`ElasticCallback.fit` puts the elastic
callback last, so that what the others do at the end of a batch or an epoch
happens before the commit that follows it, and one of its own first, which
makes each epoch's metrics those of the whole job (summed over the ranks, as
one process would compute them: no ``MetricAverageCallback`` is needed). What
a new ``fit`` call would reset (the epoch's metric sums, the counters of
``ReduceLROnPlateau`` and ``EarlyStopping``) is committed with the State and
put back (:mod:`elastic_ext.tensorflow.fit_carry`).
``ModelCheckpoint``, ``TensorBoard``, ``CSVLogger`` work as usual (on rank 0
only if they write to a shared place).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterable, Optional

import tensorflow as tf

from elastic_ext.errors import ConfigError, StateError
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.tensorflow.data import steps_in_epoch
from elastic_ext.tensorflow.fit_carry import FitCarry, carried
from elastic_ext.tensorflow.keras_flavour import callback_base, is_keras_model
from elastic_ext.tensorflow.fit_stream import FitStep, StepStream
from elastic_ext.tensorflow.guard import grads_ready_time

logger = logging.getLogger(__name__)

__all__ = ["ElasticCallback"]

# model.fit arguments that ElasticCallback.fit sets itself.
_OWN_FIT_ARGUMENTS = ("x", "y", "batch_size", "epochs", "initial_epoch", "steps_per_epoch", "shuffle")


class _ElasticCallbackMixin:
    """The logic of :func:`ElasticCallback`; mixed into the Keras flavour's ``Callback``."""

    def __init__(self, state: Any, load: Callable[[tf.Tensor, tf.Tensor], Any], commit_every: int,
                 sampler: Optional[ElasticPartitioner], lr_for_size: Optional[Callable[[int], float]],
                 on_step: Optional[Callable[[FitStep], None]]) -> None:
        super().__init__()
        if not isinstance(commit_every, int) or isinstance(commit_every, bool) or commit_every < 1:
            raise ConfigError(f"commit_every ({commit_every!r}) must be an integer >= 1")
        if not callable(load):
            raise ConfigError(f"load ({load!r}) must be a function (indices, pad) -> a batch for model.fit")
        objects = state.objects
        for name in ("epoch", "batch"):
            if not isinstance(objects.get(name), int) or isinstance(objects.get(name), bool):
                raise StateError(f"the State needs an integer {name!r} entry for model.fit "
                                 f"(got {objects.get(name)!r}): State(..., epoch=0, batch=0)")
        if state.guard is not None and not isinstance(objects.get("step"), int):
            raise StateError("a State with a guard needs an integer 'step' entry for model.fit (the global step "
                             f"the guard judges; got {objects.get('step')!r}): State(..., step=0)")
        if sampler is None:
            found = [obj for obj in objects.values() if isinstance(obj, ElasticPartitioner)]
            if len(found) != 1:
                raise StateError(f"the State holds {len(found)} elastic samplers; pass sampler= to choose "
                                 "the one that feeds model.fit (it must be in the State)")
            sampler = found[0]
        elif not any(obj is sampler for obj in objects.values()):
            raise StateError("sampler must be in the State, so that its cursor is committed with the weights")
        self.elastic_state = state
        self.sampler = sampler
        self.load = load
        self.commit_every = commit_every
        self.lr_for_size = lr_for_size
        self.on_step = on_step
        self.carry = FitCarry.attach(state)
        self._carried: list = []  # the callbacks of the fit call whose counters are carried
        self._stream: Optional[StepStream] = None
        self._began: Optional[float] = None

    # ------------------------------------------------------------- fit calls

    def dataset(self, end_epoch: int) -> tf.data.Dataset:
        """The batches from the committed position to the end of epoch ``end_epoch - 1``."""
        stream = StepStream(self.sampler, self.sampler.epoch, self.sampler.cursor, end_epoch)
        self._stream = stream
        return stream.dataset(self.load)

    def fit_arguments(self, epochs: int) -> Optional[Dict[str, Any]]:
        """Arguments of the next ``model.fit`` call towards ``epochs``, or None when there are none.

        Raises:
            StateError: the sampler's epoch is not the committed epoch.
        """
        state, sampler = self.elastic_state, self.sampler
        self._check_position()
        while state.epoch < epochs and sampler.epoch_done:
            # Only reachable if a commit was made at an epoch's last batch
            # outside this callback: that epoch is complete.
            self._next_epoch(state.epoch)
        if state.epoch >= epochs:
            return None
        sampler.skip_ahead()
        epoch, cursor = sampler.epoch, sampler.cursor
        # An epoch begun, or with steps the guard skips, has fewer steps than a full one: a call of its own.
        partial = cursor > 0 or any(e == epoch for e, _, _ in sampler.skipped)
        end = epoch + 1 if partial else epochs
        return {"x": self.dataset(end), "initial_epoch": epoch, "epochs": end,
                "steps_per_epoch": len(sampler) if partial else steps_in_epoch(sampler, cursor)}

    def fit(self, model: Any, epochs: int, callbacks: Iterable[Any] = (), **fit_kwargs: Any) -> Any:
        """``model.fit`` from the committed position to ``epochs``; returns the last call's History.

        Takes ``model.fit``'s other arguments (``verbose``,
        ``validation_data``...); the data, epochs and steps are set here.

        Raises:
            ConfigError: an argument that this method sets was given.
        """
        own = sorted(set(fit_kwargs) & set(_OWN_FIT_ARGUMENTS))
        if own:
            raise ConfigError(f"fit() sets {own} itself (the data comes from load(), the epochs from the state)")
        callbacks = list(callbacks)
        self._carried = carried(callbacks)
        carry = self.carry
        # First of all: the epoch's metrics of the whole job, before any callback reads the logs.
        front = type("ElasticMetrics", (callback_base(model),), {
            "on_epoch_end": lambda cb, epoch, logs=None: carry.globalize(cb.model, logs)})()
        history = None
        while True:
            arguments = self.fit_arguments(epochs)
            if arguments is None:
                return history
            history = model.fit(**arguments, callbacks=[front, *callbacks, self], **fit_kwargs)
            if getattr(model, "stop_training", False):
                return history

    # ------------------------------------------------------------- Keras hooks

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        steps = getattr(model, "steps_per_execution", None)
        if steps is None:
            variable = getattr(model, "_steps_per_execution", None)
            steps = int(variable.numpy()) if variable is not None else 1
        if int(steps) != 1:
            raise ConfigError(f"steps_per_execution ({int(steps)}) must be 1 with ElasticCallback: "
                              "it commits and checks the data position after every batch")
        if getattr(model, "jit_compile", False) is True:
            raise ConfigError("model.jit_compile is True: Horovod's collectives have no XLA kernel; "
                              "compile with jit_compile=False")
        if self._stream is None:
            raise StateError("model.fit was not fed by this callback's dataset(); use ElasticCallback.fit "
                             "or the arguments from fit_arguments()")
        if self.lr_for_size is not None:
            size = self.elastic_state.binding.size()
            value = float(self.lr_for_size(size))
            model.optimizer.learning_rate = value
            logger.info("learning rate set to %g for %d workers", value, size)
        self.carry.restore_callbacks(self._carried)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if epoch != self.elastic_state.epoch or epoch != self.sampler.epoch:
            raise StateError(f"model.fit starts epoch {epoch} but the committed state is at epoch "
                             f"{self.elastic_state.epoch} (sampler epoch {self.sampler.epoch}): call fit with "
                             "initial_epoch=state.epoch, or use ElasticCallback.fit")
        self.carry.start_epoch(self.model, inside=self.sampler.cursor > 0)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._began = time.time()  # the clock of tf.timestamp(), which marks when the gradients were ready

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        state, sampler = self.elastic_state, self.sampler
        stream = self._stream
        if stream is None or not stream.handed_out:
            raise StateError(f"batch {batch} ended but this callback's dataset handed out no step for it: "
                             "feed model.fit from ElasticCallback.dataset()")
        step = stream.handed_out.popleft()
        self.carry.after_first_batch(self.model)
        sampler.skip_ahead()
        if (step.epoch, step.cursor) != (sampler.epoch, sampler.cursor):
            raise StateError(f"the batch trained on starts at epoch {step.epoch} cursor {step.cursor} but the "
                             f"committed position is epoch {sampler.epoch} cursor {sampler.cursor}")
        ready = grads_ready_time()
        if ready is not None and self._began is not None and ready >= self._began:
            state.step_timer.add(ready - self._began)  # own compute only: not the wait in the allreduce
        if state.guard is not None:
            # Judged from the signal that rode on this batch's gradient allreduce; a bad batch raises
            # NumericFaultError out of model.fit, and run rolls back to the last commit and skips it.
            state.guard_step(None, step=state.step)
        if self.on_step is not None:
            self.on_step(step)
        sampler.record_step()
        state.batch += 1
        if isinstance(state.objects.get("step"), int):
            state.step += 1
        # Not at the epoch's last batch: the epoch-end commit follows at once.
        if state.batch % self.commit_every == 0 and not sampler.epoch_done:
            self.carry.save(self.model, self._carried, in_epoch=True)
            state.commit()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not self.sampler.epoch_done:
            raise StateError(f"epoch {epoch} ended at cursor {self.sampler.cursor} of {self.sampler.size} with "
                             "steps left: steps_per_epoch must be the steps from the committed cursor")
        self._next_epoch(epoch)
        self.carry.save(self.model, self._carried, in_epoch=False)  # after the others' on_epoch_end
        self.elastic_state.commit()

    # ------------------------------------------------------------- helpers

    def _next_epoch(self, epoch: int) -> None:
        state = self.elastic_state
        state.epoch = epoch + 1
        state.batch = 0
        self.sampler.set_epoch(epoch + 1)

    def _check_position(self) -> None:
        if self.sampler.epoch != self.elastic_state.epoch:
            raise StateError(f"the sampler is at epoch {self.sampler.epoch} but the state at epoch "
                             f"{self.elastic_state.epoch}; commit them together (both in the State)")


_CALLBACK_CLASSES: Dict[type, type] = {}


def ElasticCallback(state: Any, load: Callable[[tf.Tensor, tf.Tensor], Any], *, commit_every: int = 10,
                    model: Any = None, sampler: Optional[ElasticPartitioner] = None,
                    lr_for_size: Optional[Callable[[int], float]] = None,
                    on_step: Optional[Callable[[FitStep], None]] = None) -> Any:
    """A Keras callback (of the model's Keras, 2 or 3) that makes ``model.fit`` elastic.

    Args:
        state: the :class:`elastic_ext.State`, with integer ``epoch`` and
            ``batch`` entries (and optionally ``step``, counted too), the
            model, its optimizer and the sampler.
        load: ``load(indices, pad)`` -> the batch ``model.fit`` trains on,
            e.g. ``(x, y, sample_weight)`` with zero weight where ``pad``;
            runs in a ``tf.data`` map (graph mode).
        commit_every: batches between commits (and one at every epoch end).
        model: the Keras model (default: the State's only Keras model).
        sampler: the elastic sampler (default: the State's only one).
        lr_for_size: ``lr_for_size(world_size)`` -> the learning rate, set
            at the start of every ``fit`` call, so after every reset.
        on_step: called with each :class:`FitStep` after Keras trained on it
            (e.g. a sample ledger).

    Raises:
        ConfigError: bad ``commit_every`` or ``load``, or no Keras model.
        StateError: the State lacks ``epoch``/``batch`` or the sampler.
    """
    if model is None:
        found = [obj for obj in state.objects.values() if is_keras_model(obj)]
        if len(found) != 1:
            raise ConfigError(f"the State holds {len(found)} Keras models; pass model=")
        model = found[0]
    base = callback_base(model)
    cls = _CALLBACK_CLASSES.get(base)
    if cls is None:
        cls = type("ElasticCallback", (_ElasticCallbackMixin, base), {"__module__": __name__})
        _CALLBACK_CLASSES[base] = cls
    return cls(state, load, commit_every, sampler, lr_for_size, on_step)

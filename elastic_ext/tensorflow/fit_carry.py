"""What ``model.fit`` forgets between two calls, carried in the State, and the epoch's metrics of the whole
job: the metric sums and the counters of Keras's ``ReduceLROnPlateau`` and ``EarlyStopping``.

Each rank's Keras metrics are sums over its own batches. At every epoch's
end :meth:`FitCarry.globalize` adds them up over the ranks (one allgather)
and puts the job's sums into every rank's metrics, so the epoch's logs (the
``loss`` that ``ReduceLROnPlateau`` and ``EarlyStopping`` watch) are those of
the whole global batch, as on one process, at any world size; the callback
that does it runs first.

``ElasticCallback.fit`` calls ``model.fit`` again after every reset, and a
call that starts inside an epoch finishes that epoch alone. Each new call
resets what one uninterrupted ``fit`` keeps: Keras resets its metrics as every
epoch begins, and those callbacks reset their best value and patience
counters in ``on_train_begin``. So before every commit the elastic callback
writes them into a plain entry of the State (:data:`CARRY_NAME`), committed,
restored and synced with everything else: the counters, and inside an epoch
the job's metric sums so far (the same allgather). It writes them back where
a new call reset them: the counters at ``on_train_begin`` (the elastic
callback runs last, after theirs reset them), and the sums at the first
``on_epoch_begin`` of a call that starts inside an epoch, into rank 0's
metrics (the others start from zero), or added at the end of its first batch
where its metrics are not built yet (a newcomer's are built by its first
step; Keras's metric variables are sums and counts, so adding is exact).

``EarlyStopping(restore_best_weights=True)`` keeps a copy of the weights that
the State does not carry: it is refused.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

from elastic_ext.errors import ConfigError, StateError

logger = logging.getLogger(__name__)

#: The State entry (a plain dict) that carries it.
CARRY_NAME = "elastic_ext_fit"
#: Per Keras callback class: the attributes a new ``fit`` call resets and a single ``fit`` keeps.
#: (Not ``ModelCheckpoint``'s ``best``: it is often on rank 0 alone, never reset by a call, and decides only
#: which files it writes.)
CARRIED = {"ReduceLROnPlateau": ("best", "wait", "cooldown_counter"),
           "EarlyStopping": ("best", "wait", "stopped_epoch", "best_epoch")}


def _plain(value: Any) -> Any:
    """A callback attribute as a plain value the State commits (floats as floats, inf included)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.integer):
        return int(value)
    raise StateError(f"a Keras callback attribute holds {type(value).__name__} {value!r}; "
                     "only numbers and None are carried across model.fit calls")


def _as(variable: Any, value: Any) -> np.ndarray:
    """A committed value in ``variable``'s dtype and shape (Keras 3 names its dtype, tf_keras gives a DType)."""
    return np.asarray(value).astype(str(getattr(variable.dtype, "name", variable.dtype))).reshape(
        tuple(variable.shape))


def _metric_variables(model: Any) -> List[Any]:
    return [v for metric in getattr(model, "metrics", []) for v in getattr(metric, "variables", [])]


def carried(callbacks: Iterable[Any]) -> List[Any]:
    """The callbacks whose counters are carried, in order.

    Raises:
        ConfigError: an ``EarlyStopping`` restores its best weights (not carried).
    """
    found = [cb for cb in callbacks if type(cb).__name__ in CARRIED]
    for cb in found:
        if type(cb).__name__ == "EarlyStopping" and getattr(cb, "restore_best_weights", False):
            raise ConfigError("EarlyStopping(restore_best_weights=True) keeps a copy of the weights that the "
                              "State does not commit, so it cannot resume exactly after a reset: use "
                              "restore_best_weights=False and a ModelCheckpoint(save_best_only=True)")
    return found


class FitCarry:
    """The carried values, in the State's plain entry ``store`` (see the module docstring)."""

    def __init__(self, store: Dict[str, Any], binding: Any) -> None:
        self.store = store
        self.binding = binding
        self._add_after_batch: Optional[List[Any]] = None

    @classmethod
    def attach(cls, state: Any) -> "FitCarry":
        """The carry of ``state``, its entry added on first use (every rank makes its callback alike).

        Raises:
            StateError: the State tracks something else under :data:`CARRY_NAME`.
        """
        existing = state.objects.get(CARRY_NAME)
        if existing is None:
            existing = {}
            state._add_object(CARRY_NAME, existing)
        elif not isinstance(existing, dict):
            raise StateError(f"the State tracks {CARRY_NAME!r} as {type(existing).__name__}; ElasticCallback "
                             "keeps model.fit's own state under that name: rename that object")
        return cls(existing, state.binding)

    def job_sums(self, model: Any) -> List[np.ndarray]:
        """Every metric variable summed over the ranks (one allgather, on every rank together)."""
        variables = _metric_variables(model)
        mine = [np.asarray(v.numpy(), dtype=np.float64) for v in variables]
        flat = np.concatenate([m.reshape(-1) for m in mine]) if mine else np.zeros(0)
        total = self.binding.allgather(flat[None, :], "elastic_ext.fit.metrics").sum(axis=0)
        out, offset = [], 0
        for m in mine:
            out.append(total[offset:offset + m.size].reshape(m.shape))
            offset += m.size
        return out

    def globalize(self, model: Any, logs: Any) -> None:
        """At an epoch's end, before any other callback: the job's sums in every rank's metrics, and the
        logs recomputed from them."""
        variables = _metric_variables(model)
        for variable, total in zip(variables, self.job_sums(model)):
            variable.assign(_as(variable, total))
        if logs is None:
            return
        results = model.get_metrics_result() if hasattr(model, "get_metrics_result") else {
            metric.name: metric.result() for metric in getattr(model, "metrics", [])}
        for name, value in results.items():
            if name in logs:
                logs[name] = float(np.asarray(value))

    def save(self, model: Any, callbacks: Iterable[Any], in_epoch: bool) -> None:
        """Before a commit (every rank together): the callbacks' counters, and inside an epoch the job's
        metric sums so far."""
        self.store["callbacks"] = [[type(cb).__name__, {name: _plain(getattr(cb, name, None))
                                                        for name in CARRIED[type(cb).__name__]}]
                                   for cb in callbacks]
        self.store["metrics"] = [total.tolist() for total in self.job_sums(model)] if in_epoch else []

    def restore_callbacks(self, callbacks: List[Any]) -> None:
        """At the start of a ``fit`` call, after the callbacks reset themselves: their committed counters."""
        saved = self.store.get("callbacks") or []
        if [name for name, _ in saved] != [type(cb).__name__ for cb in callbacks]:
            if saved:
                logger.warning("model.fit's callbacks %s are not those committed (%s): their counters start "
                               "afresh", [type(cb).__name__ for cb in callbacks], [name for name, _ in saved])
            return
        for cb, (_, values) in zip(callbacks, saved):
            for name, value in values.items():
                setattr(cb, name, value)

    def start_epoch(self, model: Any, inside: bool) -> None:
        """As a call's first epoch begins (after Keras reset the metrics): the committed job's sums into
        rank 0's metrics, if the call starts ``inside`` an epoch; assigned now, or added after the first batch."""
        self._add_after_batch = None
        saved = self.store.get("metrics") or []
        if not inside or not saved or self.binding.rank() != 0:
            return
        variables = _metric_variables(model)
        if len(variables) == len(saved):
            for variable, value in zip(variables, saved):
                variable.assign(_as(variable, value))
        else:
            self._add_after_batch = saved

    def after_first_batch(self, model: Any) -> None:
        """At a batch's end: the committed sums added, if :meth:`start_epoch` could not assign them."""
        saved, self._add_after_batch = self._add_after_batch, None
        if saved is None:
            return
        variables = _metric_variables(model)
        if len(variables) != len(saved):
            logger.warning("the model has %d metric variables, the commit %d: this epoch's logs cover only the "
                           "batches since the restart", len(variables), len(saved))
            return
        for variable, value in zip(variables, saved):
            variable.assign_add(_as(variable, value))

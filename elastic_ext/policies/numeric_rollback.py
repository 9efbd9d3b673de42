"""The numeric guard wired into ``State``: the reserved loss window and the checked steps.

:mod:`elastic_ext.policies.guard` decides whether a step is a numeric fault; this
module is what ``State(guard=...)``, ``state.guard_step(...)`` and
``state.commit()`` do with that decision (what ``run`` does next is
:mod:`elastic_ext.runtime.numeric_recovery`):

- :func:`attach` tracks the guard's :class:`~elastic_ext.policies.guard.LossWindow`
  in the State as the reserved committed object :data:`WINDOW_NAME`, so a
  rollback restores it and ``sync`` hands it to newcomers.
- :class:`GuardedSteps` gets each step's agreed signal in the cheapest way
  the framework allows, and judges it. On a fault every rank raises the
  same :class:`~elastic_ext.errors.NumericFaultError`, carrying the sample
  range each elastic sampler consumed in the bad step:

  * **carried** (TensorFlow with elastic_ext's ``DistributedGradientTape``
    or Keras ``DistributedOptimizer``): the signal rode on the step's own
    gradient allreduce (:mod:`elastic_ext.tensorflow.guard`); no collective,
    the step is judged at once;
  * **in the background** (a binding that starts an allgather in Horovod's
    background thread: PyTorch): the step's row is allgathered while the
    next step computes, and the step is judged at the next ``guard_step``
    or at ``commit()``, whichever comes first, before the weights it
    produced can be committed. A bad step is then found one step later; the
    rollback to the last commit undoes both, and only the bad step's
    samples are skipped;
  * **blocking** (any other binding): one allgather now, judged at once.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from elastic_ext.binding import allgather_start
from elastic_ext.errors import ConfigError, NumericFaultError, StateError
from elastic_ext.policies.guard import NumericGuard, Verdict
from elastic_ext.policies.numeric_signal import GlobalSignal, LocalSignal, agree, reduce_rows

#: Name under which a State with a guard tracks the guard's LossWindow (reserved: no user object may take it).
WINDOW_NAME = "numeric_guard_window"

Skip = Tuple[str, int, int, int]  # (sampler name, epoch, start, stop)


def attach(tracked: Any, guard: Optional[NumericGuard]) -> None:
    """Tracks ``guard``'s loss window among ``tracked``'s objects (a no-op for None).

    Raises:
        ConfigError: ``guard`` is neither None nor a :class:`NumericGuard`.
    """
    if guard is None:
        return
    if not isinstance(guard, NumericGuard):
        raise ConfigError(f"guard ({guard!r}) must be an elastic_ext.NumericGuard or None")
    tracked.objects[WINDOW_NAME] = guard.new_window()


#: The module whose ``local_row`` computes a framework's signal row, imported by name
#: (like the bindings) so that the core imports no framework package.
_ROW_MODULES = {"torch": "elastic_ext.torch.guard", "tensorflow": "elastic_ext.tensorflow.guard"}


def _local_row(framework: str, loss: Any, grads: Iterable[Any], samples: int) -> np.ndarray:
    module = _ROW_MODULES.get(framework)
    if module is not None:
        local_row = importlib.import_module(module).local_row
        return np.asarray(local_row(loss, grads, samples), dtype=np.float64)
    loss = float(loss)  # another binding (tests): a plain loss, no gradients
    return LocalSignal(loss=loss, samples=int(samples), loss_finite=np.isfinite(loss)).row()


class GuardedSteps:
    """One State's checked steps: the guard, and the step whose signal is still on its way.

    Args:
        guard: the rules (None: every call raises ``StateError``).
        frameworks: those of the State's objects and binding; TensorFlow's gradient
            reduction then carries the signal.
    """

    def __init__(self, guard: Optional[NumericGuard], frameworks: Iterable[str] = ()) -> None:
        self.guard = guard
        self._pending: Optional[Tuple[Callable[[], np.ndarray], int, List[Skip]]] = None
        # The frameworks whose gradient reduction may carry the signal (the objects', the binding's).
        self._carriers = [importlib.import_module(_ROW_MODULES[f]) for f in sorted(set(frameworks))
                          if f in _ROW_MODULES and guard is not None]
        for module in self._carriers:
            enable = getattr(module, "enable_carry", None)
            if enable is not None:
                enable()  # before the training step is traced: its gradient reduction carries the signal

    def step(self, binding: Any, objects: Mapping[str, Any], samplers: Iterable[str], loss: Any,
             grads: Iterable[Any] = (), samples: int = 1, step: Optional[int] = None) -> Optional[Verdict]:
        """Checks one step on every rank together (see the module docstring); returns the verdict
        reached in this call (this step's, the previous step's when judged in the background, or None).

        ``objects`` are the State's tracked objects (the window among them) and
        ``samplers`` the names of its synced elastic samplers, whose current step
        ranges a fault's ``skips`` name.

        Raises:
            StateError: the State has no guard, or no global step is known
                (pass ``step=`` or track an integer named ``step``), or ``loss``
                is None and no signal was carried on the gradient allreduce.
            ConfigError: ``samples`` is not an integer >= 0.
            NumericFaultError: a step is bad (the same verdict on every rank).
        """
        if self.guard is None:
            raise StateError("guard_step() needs a guard: State(..., guard=elastic_ext.NumericGuard())")
        if step is None:
            step = objects.get("step")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
            raise StateError(f"guard_step() needs the global step as an int, got step={step!r}: pass step= or "
                             "track an integer named 'step' in the State")
        if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or samples < 0:
            raise ConfigError(f"samples ({samples!r}) must be an integer >= 0")
        verdict = self.settle(objects)
        skips = _step_ranges(objects, samplers)
        carried = next((c for c in (getattr(m, "carried_signal", lambda: None)() for m in self._carriers)
                        if c is not None), None)
        if carried is not None:
            return self._judge(int(step), carried, skips, objects)
        if loss is None:
            raise StateError("guard_step(None) judges the signal carried on the gradient allreduce, and none came: "
                             "reduce gradients with elastic_ext.tensorflow.DistributedGradientTape or "
                             "DistributedOptimizer, or pass the loss")
        row = _local_row(binding.framework, loss, grads, samples)
        wait = allgather_start(binding, row, GATHER_NAME)
        if wait is not None:
            self._pending = (wait, int(step), skips)
            return verdict
        return self._judge(int(step), agree(binding, row, GATHER_NAME), skips, objects)

    def settle(self, objects: Mapping[str, Any]) -> Optional[Verdict]:
        """Judges the step whose allgather runs in the background, if any (before a commit's snapshot).

        Raises:
            NumericFaultError: that step is bad.
        """
        if self._pending is None:
            return None
        wait, step, skips = self._pending
        self._pending = None
        return self._judge(step, reduce_rows(wait()), skips, objects)

    def drop(self) -> None:
        """Forgets the step in flight (a restore: that step is undone; its collective completes unread)."""
        self._pending = None

    def _judge(self, step: int, signal: GlobalSignal, skips: List[Skip], objects: Mapping[str, Any]) -> Verdict:
        try:
            return self.guard.check(step, signal, objects[WINDOW_NAME])
        except NumericFaultError as exc:
            exc.skips.extend(skips)
            raise


GATHER_NAME = "elastic_ext.policies.guard"


def _step_ranges(objects: Mapping[str, Any], samplers: Iterable[str]) -> List[Skip]:
    """The sample range each elastic sampler hands out in the current step (what a fault skips)."""
    skips = []
    for name in samplers:
        epoch, start, stop = objects[name].step_range()
        if stop > start:
            skips.append((name, epoch, start, stop))
    return skips

"""The numeric guard wired into ``State``: the reserved loss window and the checked step.

:mod:`elastic_ext.policies.guard` decides whether a step is a numeric fault; this
module is what ``State(guard=...)`` and ``state.guard_step(...)`` do with that
decision (what ``run`` does next is :mod:`elastic_ext.runtime.numeric_recovery`):

- :func:`attach` tracks the guard's :class:`~elastic_ext.policies.guard.LossWindow`
  in the State as the reserved committed object :data:`WINDOW_NAME`, so a
  rollback restores it and ``sync`` hands it to newcomers.
- :func:`guard_step` computes this rank's signal row with the framework's
  helper, runs the guard's one allgather and judges the step. On a fault
  every rank raises the same :class:`~elastic_ext.errors.NumericFaultError`,
  carrying the sample range each elastic sampler would have consumed.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable, Mapping, Optional, Tuple

import numpy as np

from elastic_ext.errors import ConfigError, NumericFaultError, StateError
from elastic_ext.policies.guard import NumericGuard, Verdict
from elastic_ext.policies.numeric_signal import LocalSignal, agree

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


def guard_step(guard: Optional[NumericGuard], binding: Any, objects: Mapping[str, Any], samplers: Iterable[str],
               loss: Any, grads: Iterable[Any] = (), samples: int = 1, step: Optional[int] = None) -> Verdict:
    """Judges one step on every rank together (one allgather); a good step's loss joins the window.

    ``objects`` are the State's tracked objects (the window among them) and
    ``samplers`` the names of its synced elastic samplers, whose current step
    ranges a fault's ``skips`` name.

    Raises:
        StateError: the State has no guard, or no global step is known
            (pass ``step=`` or track an integer named ``step``).
        ConfigError: ``samples`` is not an integer >= 0.
        NumericFaultError: the step is bad (the same verdict on every rank);
            its ``skips`` name the sample ranges the step would have consumed.
    """
    if guard is None:
        raise StateError("guard_step() needs a guard: State(..., guard=elastic_ext.NumericGuard())")
    if step is None:
        step = objects.get("step")
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
        raise StateError(f"guard_step() needs the global step as an int, got step={step!r}: pass step= or "
                         "track an integer named 'step' in the State")
    if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or samples < 0:
        raise ConfigError(f"samples ({samples!r}) must be an integer >= 0")
    signal = agree(binding, _local_row(binding.framework, loss, grads, samples))
    try:
        return guard.check(int(step), signal, objects[WINDOW_NAME])
    except NumericFaultError as exc:
        for name in samplers:
            epoch, start, stop = objects[name].step_range()
            if stop > start:
                exc.skips.append((name, epoch, start, stop))
        raise

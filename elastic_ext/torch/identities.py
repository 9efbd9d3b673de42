"""PyTorch restores that keep identities: an optimizer's groups and state stay the objects users hold.

An LR scheduler built on an optimizer before ``hvd.DistributedOptimizer``
wrapped it writes into the group dicts the two share; a user's
``group = optimizer.param_groups[0]`` or an EMA helper does the same. A
restore must bring the values back into those objects, and a scheduler whose
optimizer the State does not hold cannot be restored consistently at all.
"""

from __future__ import annotations

import torch

from elastic_ext.errors import StateError

# Optimizers, LR schedulers (ReduceLROnPlateau included) and gradient scalers.
STATEFUL_TYPES = tuple(t for t in (
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None),
    getattr(getattr(torch, "amp", None), "GradScaler", None),
    getattr(getattr(getattr(torch, "cuda", None), "amp", None), "GradScaler", None),
) if isinstance(t, type))


def load_keeping_identities(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict(state_dict)`` that changes values, never identities.

    ``Optimizer.load_state_dict`` installs a new ``param_groups`` list of new
    dicts and a new ``state`` mapping. Whatever holds the old ones then writes
    where the optimizer no longer reads: an LR scheduler built on the optimizer
    before ``hvd.DistributedOptimizer`` wrapped it (the wrapper shares the
    original's group dicts), a user's ``group = optimizer.param_groups[0]``,
    an EMA helper. So the loaded values are copied back into the optimizer's
    own list, group dicts and per-parameter state dicts, which stay in place.
    """
    groups, group_dicts = optimizer.param_groups, list(optimizer.param_groups)
    old_state = optimizer.state
    per_param = dict(old_state.items())
    optimizer.load_state_dict(state_dict)
    for old, new in zip(group_dicts, optimizer.param_groups):
        if old is not new:
            loaded = dict(new)
            old.clear()
            old.update(loaded)
    groups[:] = group_dicts
    loaded_state = dict(optimizer.state.items())
    old_state.clear()
    for param, values in loaded_state.items():
        kept = per_param.get(param)
        if kept is not None and kept is not values and isinstance(kept, dict):
            fresh = dict(values)
            kept.clear()
            kept.update(fresh)
            values = kept
        old_state[param] = values
    optimizer.param_groups = groups
    optimizer.state = old_state


def check_schedulers(objects: dict) -> None:
    """Every tracked LR scheduler drives a tracked optimizer: one that holds the scheduler's own
    optimizer's group dicts (itself, or ``hvd.DistributedOptimizer`` built on it).

    A scheduler restored without its optimizer would rewind its step count while the optimizer keeps
    the learning rate it had: the two disagree from then on.

    Raises:
        StateError: a scheduler's optimizer is not tracked (the message names both and what to do).
    """
    optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
    held = {id(group) for optimizer in optimizers for group in optimizer.param_groups}
    for name, obj in objects.items():
        driven = getattr(obj, "optimizer", None)
        if not isinstance(obj, STATEFUL_TYPES) or not isinstance(driven, torch.optim.Optimizer):
            continue
        if not any(id(group) in held for group in driven.param_groups):
            raise StateError(
                f"scheduler {name!r} ({type(obj).__name__}) drives an optimizer ({type(driven).__name__}) that this "
                "State does not track: a restore would rewind the scheduler but not the learning rate it set. "
                "Track the optimizer too, e.g. State(optimizer=optimizer, "
                f"{name}={name}, ...) (the hvd.DistributedOptimizer built on it counts)")

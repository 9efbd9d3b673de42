"""How the State shows its parts' methods as its own.

:class:`~elastic_ext.state.state.CoreState` is composed of parts, each a
plain class built with what it uses and held in a field:
``_listener`` (:class:`~elastic_ext.state.listener.HorovodListener`),
``_durable`` (:class:`~elastic_ext.state.durable.DurableCommits`) and
``_restorer`` (:class:`~elastic_ext.state.restoring.Restorer`). What the
State may replace after they are built (the policies plugged in later, the
binding, the liveness) they reach through callables that look it up when
called; the commit id through the :class:`~elastic_ext.state.records.CommitRecord`
that owns it.

A public method that a part implements is a :class:`Delegated` in the
State's class body, so that Horovod's notification manager and the run loop
call it on the State itself, and its docstring is written once, on the part.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional


class Delegated:
    """A public method of the State that one of its parts implements: ``state.name(...)`` calls
    ``state.<part>.name(...)``; its docstring and signature are the part's (``help``, ``inspect``).

    Like a method: an instance attribute of the same name shadows it (a non-data descriptor), and
    on the class it takes the State first (``State.restore(state)``).
    """

    def __init__(self, part: str, method: Callable[..., Any]) -> None:
        self.part, self.name = part, method.__name__
        functools.update_wrapper(self, method)

    def __get__(self, state: Any, owner: Optional[type] = None) -> Any:
        return self if state is None else getattr(getattr(state, self.part), self.name)

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(state, self.part), self.name)(*args, **kwargs)

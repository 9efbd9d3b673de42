"""Methods of Horovod's classes that the launcher replaces in the driver's process, and putting them back.

Each module that changes Horovod's driver keeps its own record of what it
replaced, ``(class, name) -> original``, so that its ``uninstall()`` (tests
that run Horovod's behaviour and the launcher's in one process) restores
exactly its own changes.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Tuple

Originals = Dict[Tuple[type, str], Any]


def replace(originals: Originals, changes: Iterable[Tuple[type, str, Any]]) -> None:
    """Sets each ``(class, name, replacement)`` of ``changes``, recording the original in ``originals``."""
    for cls, name, replacement in changes:
        originals[(cls, name)] = getattr(cls, name)
        setattr(cls, name, replacement)


def restore(originals: Originals) -> None:
    """Puts back every original recorded in ``originals`` and empties it."""
    for (cls, name), original in originals.items():
        setattr(cls, name, original)
    originals.clear()

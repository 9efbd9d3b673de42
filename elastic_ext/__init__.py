"""elastic_ext: fault-tolerant Horovod elastic training for PyTorch and TensorFlow.

Importing the package changes nothing in the process: it forks nothing,
patches nothing of Horovod, writes no environment variable and installs no
signal handler. What a worker needs before the user's code runs is done by
the launcher, ``elastic-horovodrun`` (:mod:`elastic_ext.worker.entry`).
The core imports no framework: ``elastic_ext.torch`` and
``elastic_ext.tensorflow`` are loaded only when the objects handed to
:class:`State` (or the user) need them.

The names below are loaded when first used (PEP 562), so that a process that
needs one corner of the package (a discovery script, which Horovod's driver
runs every second, or a worker's guardian) does not pay for the rest.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing's own flag, without importing typing (type checkers read it as True)
if TYPE_CHECKING:
    from elastic_ext.config import ElasticConfig
    from elastic_ext.data.sampler import ElasticPartitioner
    from elastic_ext.errors import (CheckpointError, ConfigError, CorruptCheckpointError, DiscoveryError,
                                    ElasticExtError, NotCommittedError, NumericFaultError, NumericRollbackLimitError,
                                    PartitionError, ReplicaMismatchError, RollbackLimitError, StateDivergenceError,
                                    StateError)
    from elastic_ext.liveness import phase, progress
    from elastic_ext.policies.guard import LossWindow, NumericGuard
    from elastic_ext.policies.step_timer import StepTimer
    from elastic_ext.policies.straggler import StragglerPolicy
    from elastic_ext.runtime.run import run
    from elastic_ext.state.adapters import Adapter, GlobalRNG
    from elastic_ext.state.snapshot import Capture, Entry
    from elastic_ext.runtime.assembly import State

__version__ = "0.1.0"

_ERRORS = ("CheckpointError", "ConfigError", "CorruptCheckpointError", "DiscoveryError", "ElasticExtError",
           "NotCommittedError", "NumericFaultError", "NumericRollbackLimitError", "PartitionError",
           "ReplicaMismatchError", "RollbackLimitError", "StateDivergenceError", "StateError")
# public name -> the module that defines it
_WHERE = {
    "Adapter": "elastic_ext.state.adapters", "GlobalRNG": "elastic_ext.state.adapters",
    "Capture": "elastic_ext.state.snapshot", "Entry": "elastic_ext.state.snapshot",
    "ElasticConfig": "elastic_ext.config",
    **{name: "elastic_ext.errors" for name in _ERRORS},
    "LossWindow": "elastic_ext.policies.guard", "NumericGuard": "elastic_ext.policies.guard",
    "run": "elastic_ext.runtime.run",
    "ElasticPartitioner": "elastic_ext.data.sampler",
    "State": "elastic_ext.runtime.assembly",
    "StepTimer": "elastic_ext.policies.step_timer",
    "StragglerPolicy": "elastic_ext.policies.straggler",
    "phase": "elastic_ext.liveness", "progress": "elastic_ext.liveness",
}

__all__ = [
    "Adapter", "Capture", "Entry", "GlobalRNG", "ElasticConfig", "ElasticPartitioner", "State", "run", "phase", "progress",
    "ElasticExtError", "ConfigError", "DiscoveryError", "PartitionError", "StateError", "NotCommittedError",
    "StateDivergenceError", "CheckpointError", "CorruptCheckpointError", "RollbackLimitError",
    "NumericGuard", "LossWindow", "NumericFaultError", "NumericRollbackLimitError", "ReplicaMismatchError",
    "StragglerPolicy", "StepTimer",
]


def __getattr__(name: str) -> object:
    """Loads a public name on first use (``elastic_ext.State``, ``from elastic_ext import run``)."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'elastic_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

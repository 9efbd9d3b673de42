"""elastic_ext: fault-tolerant Horovod elastic training for PyTorch and TensorFlow.

The core imports no framework: ``elastic_ext.torch`` and
``elastic_ext.tensorflow`` are loaded only when the objects handed to
:class:`State` (or the user) need them.
"""

from elastic_ext.adapters import Adapter, Capture, Entry, GlobalRNG
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import (CheckpointError, ConfigError, CorruptCheckpointError, DiscoveryError,
                                ElasticExtError, NotCommittedError, NumericFaultError, NumericRollbackLimitError,
                                PartitionError, RollbackLimitError, StateDivergenceError, StateError)
from elastic_ext.guard import LossWindow, NumericGuard
from elastic_ext.run import run
from elastic_ext.sampler import ElasticPartitioner
from elastic_ext.state import State
from elastic_ext.straggler import StepTimer, StragglerPolicy
from elastic_ext.watchdog import phase, progress

__version__ = "0.1.0"

__all__ = [
    "Adapter", "Capture", "Entry", "GlobalRNG", "ElasticConfig", "ElasticPartitioner", "State", "run", "phase", "progress",
    "ElasticExtError", "ConfigError", "DiscoveryError", "PartitionError", "StateError", "NotCommittedError",
    "StateDivergenceError", "CheckpointError", "CorruptCheckpointError", "RollbackLimitError",
    "NumericGuard", "LossWindow", "NumericFaultError", "NumericRollbackLimitError",
    "StragglerPolicy", "StepTimer",
]

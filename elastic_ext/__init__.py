"""elastic_ext: fault-tolerant Horovod elastic training for PyTorch and TensorFlow.

Importing the package changes nothing in the process: it forks nothing,
patches nothing of Horovod, writes no environment variable and installs no
signal handler. What a worker needs before the user's code runs is done by
the launcher, ``elastic-horovodrun`` (:mod:`elastic_ext.launch.worker`).
The core imports no framework: ``elastic_ext.torch`` and
``elastic_ext.tensorflow`` are loaded only when the objects handed to
:class:`State` (or the user) need them.
"""

from elastic_ext.state.adapters import Adapter, GlobalRNG
from elastic_ext.state.snapshot import Capture, Entry
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import (CheckpointError, ConfigError, CorruptCheckpointError, DiscoveryError,
                                ElasticExtError, NotCommittedError, NumericFaultError, NumericRollbackLimitError,
                                PartitionError, RollbackLimitError, StateDivergenceError, StateError)
from elastic_ext.policies.guard import LossWindow, NumericGuard
from elastic_ext.runtime.run import run
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.state.state import State
from elastic_ext.policies.step_timer import StepTimer
from elastic_ext.policies.straggler import StragglerPolicy
from elastic_ext.liveness import phase, progress

__version__ = "0.1.0"

__all__ = [
    "Adapter", "Capture", "Entry", "GlobalRNG", "ElasticConfig", "ElasticPartitioner", "State", "run", "phase", "progress",
    "ElasticExtError", "ConfigError", "DiscoveryError", "PartitionError", "StateError", "NotCommittedError",
    "StateDivergenceError", "CheckpointError", "CorruptCheckpointError", "RollbackLimitError",
    "NumericGuard", "LossWindow", "NumericFaultError", "NumericRollbackLimitError",
    "StragglerPolicy", "StepTimer",
]

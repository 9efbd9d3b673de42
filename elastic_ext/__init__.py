"""elastic_ext: fault-tolerant Horovod elastic training for PyTorch and TensorFlow.

The core imports no framework: ``elastic_ext.torch`` and
``elastic_ext.tensorflow`` are loaded only when the objects handed to
:class:`State` (or the user) need them.
"""

from elastic_ext.state.adapters import Adapter, Capture, Entry, GlobalRNG
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
from elastic_ext.state.liveness import phase, progress

from elastic_ext.launch import keeper as _keeper
from elastic_ext.launch import newcomer as _newcomer
from elastic_ext.launch.gloo_timeout import first_rendezvous_timeout as _first_rendezvous_timeout
from elastic_ext.runtime.sigterm import install_early_sigterm as _install_early_sigterm

# Under an elastic horovodrun (elsewhere these do nothing): with
# ELASTIC_EXT_RESTART_IN_PLACE=1 this process becomes a keeper that restarts
# the script's process when Gloo kills it while its round forms; a newcomer that
# survivors with prestart_newcomers started early builds its model in a
# Horovod world of one and joins at @elastic_ext.run (elastic_ext.launch.prestart);
# a newcomer's first hvd.init() waits for its peers as long as the
# survivors' resets do; and a SIGTERM before @elastic_ext.run means leave at
# the first commit, not die while the job's next round forms.
_keeper.install()
_newcomer.install()
_first_rendezvous_timeout()
_install_early_sigterm()

__version__ = "0.1.0"

__all__ = [
    "Adapter", "Capture", "Entry", "GlobalRNG", "ElasticConfig", "ElasticPartitioner", "State", "run", "phase", "progress",
    "ElasticExtError", "ConfigError", "DiscoveryError", "PartitionError", "StateError", "NotCommittedError",
    "StateDivergenceError", "CheckpointError", "CorruptCheckpointError", "RollbackLimitError",
    "NumericGuard", "LossWindow", "NumericFaultError", "NumericRollbackLimitError",
    "StragglerPolicy", "StepTimer",
]

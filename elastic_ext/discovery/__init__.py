"""Host discovery for ``horovodrun --host-discovery-script``.

Providers (:mod:`.slurm`, :mod:`.aws`, :mod:`.static`) return
:class:`~elastic_ext.discovery.hosts.HostSlots`; :mod:`.hosts` checks every
host against Horovod's format rules; :mod:`.cli` turns a provider into a
script with bounded run time, clean stdout and documented exit codes; the
executables in ``host_discovery/`` call :mod:`.commands`.

This package imports only the standard library at import time; the Slurm
provider needs python-hostlist and the AWS provider boto3 when they run.
"""

from elastic_ext.discovery.cli import (EXIT_CODES, EXIT_INPUT, EXIT_INTERNAL, EXIT_OK,
                                       EXIT_TIMEOUT, EXIT_UNAVAILABLE)
from elastic_ext.discovery.deadline import Deadline
from elastic_ext.discovery.hosts import HostSlots, host_error, is_valid_host, render, usable_hosts
from elastic_ext.errors import DiscoveryInputError, DiscoveryTimeoutError, DiscoveryUnavailableError

__all__ = [
    "HostSlots", "host_error", "is_valid_host", "render", "usable_hosts", "Deadline",
    "DiscoveryInputError", "DiscoveryUnavailableError", "DiscoveryTimeoutError",
    "EXIT_OK", "EXIT_INTERNAL", "EXIT_INPUT", "EXIT_UNAVAILABLE", "EXIT_TIMEOUT", "EXIT_CODES",
]

#!/usr/bin/env python3
"""Horovod host discovery script: Slurm allocation (SLURM_JOB_NODELIST minus unhealthy nodes).

Usage: horovodrun ... --host-discovery-script 'host_discovery/slurm.py [FLAGS]'
Run with --help for flags and exit codes; see docs/discovery.md. An installed
package also provides it as the ``elastic-ext-discover-slurm`` command.
"""

import sys

import _checkout  # noqa: F401 - the elastic_ext of this checkout comes first (see _checkout.py)
from elastic_ext.discovery.commands import slurm_main

if __name__ == "__main__":
    sys.exit(slurm_main())

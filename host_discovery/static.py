#!/usr/bin/env python3
"""Horovod host discovery script: host file minus an exclude list, re-read on every call.

Usage: horovodrun ... --host-discovery-script 'host_discovery/static.py [FLAGS]'
Run with --help for flags and exit codes; see docs/discovery.md. An installed
package also provides it as the ``elastic-ext-discover-static`` command.
"""

import sys

import _checkout  # noqa: F401 - the elastic_ext of this checkout comes first (see _checkout.py)
from elastic_ext.discovery.commands import static_main

if __name__ == "__main__":
    sys.exit(static_main())

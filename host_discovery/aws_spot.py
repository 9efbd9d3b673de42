#!/usr/bin/env python3
"""Horovod host discovery script: AWS EC2 spot pool (by tags or Auto Scaling group).

Usage: horovodrun ... --host-discovery-script 'host_discovery/aws_spot.py [FLAGS]'
Run with --help for flags and exit codes; see docs/discovery.md. An installed
package also provides it as the ``elastic-ext-discover-aws-spot`` command.
"""

import sys

import _checkout  # noqa: F401 - the elastic_ext of this checkout comes first (see _checkout.py)
from elastic_ext.discovery.commands import aws_main

if __name__ == "__main__":
    sys.exit(aws_main())

#!/usr/bin/env python3
"""Horovod host discovery script: AWS EC2 spot pool (by tags or Auto Scaling group).

Usage: horovodrun ... --host-discovery-script 'host_discovery/aws_spot.py [FLAGS]'
Run with --help for flags and exit codes; see docs/discovery.md.
"""

import os
import sys

# Use the elastic_ext next to this script (a checkout), not a stale copy, and
# keep this directory off sys.path so its file names shadow no module.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
if os.path.isfile(os.path.join(_ROOT, "elastic_ext", "__init__.py")):
    sys.path.insert(0, _ROOT)

from elastic_ext.discovery.commands import aws_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(aws_main())

#!/usr/bin/env python3
"""Host discovery for the scenario tests: the hosts follow the epochs finished.

Usage: schedule_discovery.py LOGFILE SCHEDULE, SCHEDULE a JSON list of
``[EPOCH, ["host:slots", ...]]``; the entry whose EPOCH equals the number of
lines in LOGFILE (epochs rank 0 finished) wins, else the one whose EPOCH is
null. Prints one host per line, as horovodrun expects.
"""

import json
import os
import sys


def main() -> int:
    logfile, schedule = sys.argv[1], json.loads(sys.argv[2])
    done = 0
    if os.path.exists(logfile):
        with open(logfile) as handle:
            done = sum(1 for line in handle if line.strip())
    fallback = None
    for epoch, hosts in schedule:
        if epoch is None:
            fallback = hosts
        elif epoch == done:
            print("\n".join(hosts))
            return 0
    print("\n".join(fallback or []))
    return 0


if __name__ == "__main__":
    sys.exit(main())

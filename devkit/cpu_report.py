"""Where the suite's CPU goes, test by test: a pytest plugin and its summary.

The suite's length on a small machine is its CPU (docs/testing.md): this
records, for each test, the CPU seconds of its pytest process and of the
children it waited for (the jobs' launchers and workers), and its wall
seconds, one JSON line per test. Under pytest-xdist every worker appends to
the same file (one short ``write`` per line, in append mode).

    .venv/bin/python -m pytest -p devkit.cpu_report --cpu-report /tmp/cpu.jsonl tests/multiprocess/test_corpus.py
    .venv/bin/python -m devkit.cpu_report /tmp/cpu.jsonl      # by module, then the 30 costliest tests

Processes not waited for by the test's own process tree (a host's workers
started over ssh, a daemon) are not counted.
"""

import collections
import json
import os
import resource
import sys
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="FILE", help="append each test's CPU and wall seconds to FILE")


def _cpu_s():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_report")
    if not path:
        yield
        return
    cpu, start = _cpu_s(), time.time()
    yield
    line = json.dumps({"id": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2),
                       "wall_s": round(time.time() - start, 2), "start": round(start, 2)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def summary(path, top=30):
    """The report's lines: CPU and wall seconds by module (tests/unit as one), then the costliest tests."""
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        module = row["id"].split("::", 1)[0]
        module = "tests/unit" if module.startswith("tests/unit/") else module
        totals = modules[module]
        totals[0] += row["cpu_s"]
        totals[1] += row["wall_s"]
        totals[2] += 1
    lines = [f"{sum(r['cpu_s'] for r in rows):.0f} s of CPU, {sum(r['wall_s'] for r in rows):.0f} s of tests' "
             f"wall time, {len(rows)} tests", "   cpu_s  wall_s tests module"]
    for module, (cpu, wall, count) in sorted(modules.items(), key=lambda item: -item[1][0]):
        lines.append(f"{cpu:8.1f} {wall:7.1f} {count:5d} {module}")
    lines.append("   cpu_s  wall_s test")
    for row in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        lines.append(f"{row['cpu_s']:8.1f} {row['wall_s']:7.1f} {row['id']}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m devkit.cpu_report FILE")
    print("\n".join(summary(sys.argv[1])))

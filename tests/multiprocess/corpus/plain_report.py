"""Runs corpus scripts with ``--plain`` (Horovod's own ``hvd.elastic`` state and run, no elastic_ext)
under plain ``horovodrun``, failure-free on 4 workers, one job at a time, and prints how far each
ends from its one-process reference and whether its ranks agree (the table of docs/corpus.md).

Usage (from the repository root)::

    .venv/bin/python tests/multiprocess/corpus/plain_report.py [SCRIPT ...] [--out DIR]

Not part of the suite: it documents where Horovod itself deviates.
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE_DEPENDENT = ("lr_times_size",)  # the reference follows the world size
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

import numpy as np  # noqa: E402

from devkit import analysis, launch  # noqa: E402


def deviation(got, want):
    keys = sorted(k for k in want if "model/" in k)
    if sorted(k for k in got if "model/" in k) != keys:
        return float("nan")
    return max(float(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)).max()) for k in keys)


def report(name, root):
    script = os.path.join(HERE, f"{name}.py")
    reference = os.path.join(root, name, "reference")
    extra = []
    if name in SIZE_DEPENDENT:  # the plain job runs failure-free on 4 workers: 4 at every step
        sizes = os.path.join(root, f"{name}-sizes.json")
        with open(sizes, "w") as handle:
            json.dump({"0": 4}, handle)
        extra = ["--sizes", sizes]
    code, output = launch.run([sys.executable, script, "--out", reference, "--reference", *extra], launch.base_env(),
                              os.path.join(root, f"{name}-reference.log"), 300)
    if code != 0:
        return {"script": name, "reference_exit": code, "tail": output[-800:]}
    out = os.path.join(root, name, "plain")
    os.makedirs(out, exist_ok=True)
    hosts = os.path.join(out, "hosts")
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"])
    cmd = [*launch.HOROVODRUN_SCRIPT, "-np", "4", "--min-np", "2", "--max-np", "4", "--network-interfaces", "lo",
           "--host-discovery-script", f"{launch.STATIC} {hosts}", sys.executable, script, "--out", out, "--plain"]
    code, output = launch.run(cmd, launch.base_env(HOROVOD_GLOO_TIMEOUT_SECONDS=120),
                              os.path.join(root, f"{name}-plain.log"), 300)
    result = {"script": name, "plain_exit": code}
    if code != 0:
        lines = [line for line in output.splitlines() if "Error" in line or "error" in line]
        result["error"] = lines[-1][:300] if lines else output[-300:]
        return result
    finals = analysis.load_finals(out)
    want = analysis.load_finals(reference)[0]
    result["ranks_identical"] = len({tuple(v.tobytes() for _, v in sorted(f.items())) for f in finals.values()}) == 1
    result["max_deviation"] = {rank: deviation(final, want) for rank, final in sorted(finals.items())}
    result["lr"] = {rank: [float(final[k]) for k in sorted(final) if k.startswith("lr/")]
                    for rank, final in sorted(finals.items())}
    result["reference_lr"] = [float(want[k]) for k in sorted(want) if k.startswith("lr/")]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scripts", nargs="*")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    names = args.scripts or sorted(n[:-3] for n in os.listdir(HERE)
                                   if n.endswith(".py") and not n.startswith("_") and n != "plain_report.py")
    root = args.out or tempfile.mkdtemp(prefix="corpus-plain-")
    os.makedirs(root, exist_ok=True)
    for name in names:
        print(json.dumps(report(name, root)), flush=True)


if __name__ == "__main__":
    main()

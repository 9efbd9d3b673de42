"""Plain Horovod on Horovod's own elastic scenarios, on this stack: a baseline report.

Runs ``tests/multiprocess/workers/scenario_plain.py`` (Horovod's
``hvd.elastic`` state classes and ``hvd.elastic.run``, no elastic_ext) under
real horovodrun through the scenarios of Horovod's
``test/integration/elastic_common.py``, as our tests phrase them for
elastic_ext (tests/multiprocess/test_horovod_scenarios.py): the same hosts,
faults and expected outcome. For every flavour (PyTorch; TF2 loop and Keras
``fit`` on Keras 3 and on Keras 2 via TF_USE_LEGACY_KERAS=1) it records
whether plain Horovod meets the expectation, and if not why (the first error
the workers printed, or the expectation it missed). Not a test: it asserts
nothing about elastic_ext, and plain Horovod is expected to fail some.

    .venv/bin/python -m bench.horovod_scenarios            # everything, ~15 min on 2 cores
    .venv/bin/python -m bench.horovod_scenarios --flavours torch,tf3 --scenarios single_rank_failure
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from elastic_ext.testing import launch

WORKER = os.path.join(launch.WORKERS, "scenario_plain.py")
DISCOVERY = os.path.join(launch.WORKERS, "schedule_discovery.py")
RESULTS = os.path.join(launch.REPO, "bench", "results", "horovod_scenarios.json")
ADD_THEN_REMOVE = [[0, ["localhost:2"]], [1, ["localhost:2", "127.0.0.1:2"]], [None, ["127.0.0.1:2"]]]
TWO_HOSTS = [[None, ["localhost:2", "127.0.0.1:2"]]]
# flavour name -> (worker --flavour, --keras)
FLAVOURS = {"torch": ("torch", "3"), "tf3": ("tf", "3"), "tf2": ("tf", "2"),
            "keras3": ("keras", "3"), "keras2": ("keras", "2")}


def survived_on_one_host(code: int, output: str, epochs: List[dict]) -> Optional[str]:
    if code != 0:
        return f"job failed (exit {code})"
    if [e["size"] for e in epochs] != [4, 2, 2] or [e["start_rank"] for e in epochs] != [0, 2, 2]:
        return f"expected sizes [4, 2, 2] and start ranks [0, 2, 2], got {epochs}"
    return None


def grew_and_shrank(code: int, output: str, epochs: List[dict]) -> Optional[str]:
    if code != 0:
        return f"job failed (exit {code})"
    if [e["size"] for e in epochs] != [2, 4, 2] or [e["start_rank"] for e in epochs] != [0, 0, 2]:
        return f"expected sizes [2, 4, 2] and start ranks [0, 0, 2], got {epochs}"
    return None


def failed_with(message: str, epochs_done: int) -> Callable[[int, str, List[dict]], Optional[str]]:
    def check(code: int, output: str, epochs: List[dict]) -> Optional[str]:
        if code == 0:
            return "the job succeeded; it should have failed"
        if message not in output:
            return f"the job failed without {message!r}"
        if len(epochs) != epochs_done:
            return f"expected {epochs_done} epochs before the failure, got {epochs}"
        return None
    return check


def came_back(code: int, output: str, epochs: List[dict]) -> Optional[str]:
    if code != 0:
        return f"job failed (exit {code})"
    sizes = [e["size"] for e in epochs]
    # One reset for the failure, one for the host's return: generation 3 or more at the end.
    if len(sizes) != 4 or sizes[0] != 4 or sizes[-1] != 4 or epochs[-1]["generation"] < 3:
        return f"expected 4 epochs, the last on 4 workers again after at least two resets, got {epochs}"
    return None


# name -> how to run it and what must come out (the expectations of our elastic_ext tests)
SCENARIOS: Dict[str, dict] = {
    "hosts_added_and_removed": dict(schedule=ADD_THEN_REMOVE, np_=2, extra=["--epoch-wait-s", "3"],
                                    hvd=["--reset-limit", "2"], check=grew_and_shrank),
    "single_rank_failure": dict(schedule=TWO_HOSTS, np_=4, extra=["--exit-schedule", '{"1,0": [0]}'],
                                check=survived_on_one_host),
    "single_rank_failure_kill": dict(schedule=TWO_HOSTS, np_=4,
                                     extra=["--exit-schedule", '{"1,0": [0]}', "--exit-mode", "kill"],
                                     check=survived_on_one_host),
    "fault_tolerance_without_scaling": dict(fixed="localhost:2,127.0.0.1:2", np_=4,
                                            extra=["--exit-schedule", '{"1,0": [0]}'], check=survived_on_one_host),
    "all_ranks_failing": dict(schedule=TWO_HOSTS, np_=4, extra=["--exit-schedule", '{"1,0": [0, 1, 2, 3]}'],
                              check=failed_with("exited with non-zero status", 1)),
    "reset_limit_exceeded": dict(schedule=ADD_THEN_REMOVE, np_=2, extra=["--epoch-wait-s", "3"],
                                 hvd=["--reset-limit", "1"],
                                 check=failed_with("number of resets during elastic job exceeded limit: 1", 2)),
    "blacklisted_host_comes_back": dict(schedule=TWO_HOSTS, np_=4,
                                        extra=["--exit-schedule", '{"1,0": [3]}', "--epochs", "4",
                                               "--epoch-wait-s", "2"],
                                        hvd=["--blacklist-cooldown-range", "1", "2"], check=came_back),
}


def errors(output: str, limit: int = 4) -> List[str]:
    """The distinct exception lines the workers printed (Horovod prefixes worker
    lines with [rank]), then the launcher's; the scheduled exits do not count."""
    found: List[str] = []
    for worker_only in (True, False):
        for line in output.splitlines():
            if worker_only != bool(re.match(r"^\[\d+\]<std(?:err|out)>:", line)):
                continue
            text = re.sub(r"^\[\d+\]<std(?:err|out)>:", "", line).strip()
            if re.match(r"^[\w.]+(Error|Exception|Interrupt): ", text) and "scheduled exit" not in text \
                    and text[:300] not in found:
                found.append(text[:300])
    return found[:limit]


def run_one(flavour: str, name: str, spec: dict, workdir: str, timeout_s: float) -> dict:
    worker_flavour, keras = FLAVOURS[flavour]
    logfile = os.path.join(workdir, "epochs.jsonl")
    if spec.get("fixed"):
        hosts = ["-H", spec["fixed"]]
    else:
        hosts = ["--max-np", "4", "--host-discovery-script", f"{DISCOVERY} {logfile} '{json.dumps(spec['schedule'])}'"]
    cmd = [os.path.join(launch.VENV_BIN, "horovodrun"), "-np", str(spec["np_"]), "--min-np", "2", *hosts,
           *spec.get("hvd", []), "--network-interfaces", "lo", sys.executable, WORKER, "--flavour", worker_flavour,
           "--keras", keras, "--logfile", logfile, *spec["extra"]]
    started = time.monotonic()
    try:
        code, output = launch.run(cmd, launch.base_env(HOROVOD_GLOO_TIMEOUT_SECONDS=120),
                                  os.path.join(workdir, "horovodrun.log"), timeout_s)
    except AssertionError as timeout:  # launch.run raises on its hard timeout
        code, output = -1, str(timeout)
    epochs = []
    if os.path.exists(logfile):
        with open(logfile) as handle:
            epochs = [json.loads(line) for line in handle if line.strip()]
    missed = spec["check"](code, output, epochs)
    return {"flavour": flavour, "scenario": name, "passed": missed is None, "why": missed or "",
            "errors": errors(output) if missed else [], "exit_code": code, "epochs": epochs,
            "duration_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flavours", default=",".join(FLAVOURS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    results = []
    for flavour in args.flavours.split(","):
        for name in args.scenarios.split(","):
            with tempfile.TemporaryDirectory() as workdir:
                result = run_one(flavour, name, SCENARIOS[name], workdir, args.timeout_s)
            print(json.dumps(result), flush=True)
            results.append(result)
    summary = {f: {"passed": sum(r["passed"] for r in results if r["flavour"] == f),
                   "failed": sorted(r["scenario"] for r in results if r["flavour"] == f and not r["passed"])}
               for f in dict.fromkeys(r["flavour"] for r in results)}
    report = {"stack": stack(), "summary": summary, "runs": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(json.dumps(summary, indent=1))


def stack() -> dict:
    from importlib.metadata import version
    return {name: version(name) for name in ("horovod", "tensorflow", "keras", "tf_keras", "torch")}


if __name__ == "__main__":
    main()

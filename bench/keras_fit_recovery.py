"""Recovery time of an elastic ``model.fit`` job: SIGKILL to the first resumed batch.

Runs ``examples/keras_fit_elastic.py`` under horovodrun (4 workers on two
pseudo-hosts) with one worker SIGKILLed at a given step, ``--repeats`` times,
and reads two clocks the job writes anyway: the fault marker (time of the
SIGKILL, written just before it) and the sample ledger (time of every
trained step). Recovery = first step trained by the next generation minus
the SIGKILL time. Measures Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1) and
Keras 3 in one run, prints one JSON line per run and writes the medians to
bench/results/keras_fit_recovery.json.

    .venv/bin/python -m bench.keras_fit_recovery --keras 2,3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from bench import harness
from elastic_ext.testing import launch, ledger

EXAMPLE = os.path.join(launch.REPO, "examples", "keras_fit_elastic.py")


def one_run(keras: str, kill_step: int, workdir: str, timeout_s: float) -> dict:
    hosts = os.path.join(workdir, "hosts")
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"])
    book = os.path.join(workdir, "ledger")
    cmd = harness.horovodrun(EXAMPLE, ["--keras", keras, "--epochs", "2", "--commit-every", "5",
                                       "--ledger", book, "--faults", f"3:{kill_step}:kill"], hosts)
    code, output = launch.run(cmd, launch.base_env(), os.path.join(workdir, "horovodrun.log"), timeout_s)
    if code != 0:
        raise RuntimeError(f"job failed with exit code {code}:\n{output[-3000:]}")
    faults_dir = os.path.join(book, "faults")
    marks = [json.load(open(os.path.join(faults_dir, name))) for name in os.listdir(faults_dir)]
    killed_at = marks[0]["time"]
    records = ledger.read(book)
    killed_gen = max(r["gen"] for r in records if "gen" in r and r["t"] <= killed_at)
    resumed = min(r["t"] for r in records if "gen" in r and r["gen"] > killed_gen)
    return {"keras": keras, "kill_step": kill_step, "recovery_s": round(resumed - killed_at, 3),
            "resumed_generation": min(r["gen"] for r in records if "gen" in r and r["gen"] > killed_gen)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keras", default="2,3", help="Keras versions to measure, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", default=os.path.join(launch.REPO, "bench", "results", "keras_fit_recovery.json"))
    args = parser.parse_args()
    report = {"what": "SIGKILL of 1 of 4 workers to the first batch trained after the reset, model.fit "
                      "(examples/keras_fit_elastic.py), 2 cores shared", "kill_step": args.kill_step, "keras": {}}
    for keras in args.keras.split(","):
        if keras not in ("2", "3"):
            raise SystemExit(f"--keras ({keras!r}) must list 2 and/or 3")
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as workdir:
                result = one_run(keras, args.kill_step, workdir, args.timeout_s)
            print(json.dumps(result), flush=True)
            runs.append(result)
        samples = [r["recovery_s"] for r in runs]
        report["keras"][keras] = {"runs": len(samples), "median_recovery_s": statistics.median(samples),
                                  "min_s": min(samples), "max_s": max(samples), "samples_s": samples}
        print(json.dumps({"keras": keras, **report["keras"][keras]}), flush=True)
    if set(report["keras"]) == {"2", "3"}:
        report["ratio_keras3_over_keras2"] = round(
            report["keras"]["3"]["median_recovery_s"] / report["keras"]["2"]["median_recovery_s"], 2)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()

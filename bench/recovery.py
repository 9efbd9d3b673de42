"""Time from a worker's SIGKILL to the first completed step after recovery:
plain Horovod elastic against elastic_ext, side by side in one run.

4 workers on two pseudo-hosts (localhost and 127.0.0.1, 2 slots each). In
each job, rank 3 SIGKILLs itself at step 10; Horovod blacklists its host and
the job finishes on the 2 survivors. ``--failures`` jobs per system, the two
systems interleaved, the same worker script under both (see
bench/workers/recovery_worker.py).

    .venv/bin/python -m bench.recovery [--failures 10]
    .venv/bin/python -m bench.recovery --systems ext --models mlp,cnn_bn --failures 5

``--models`` picks the worker's model: ``mlp`` (the default), ``cnn_bn``, a
small CNN with BatchNorm2d whose running statistics differ between ranks, so
the survivors' sync must take them from the root, or ``big``, an MLP of
36.5M parameters (437 MB with Adam). With elastic_ext each run also records
the state bytes its recovery broadcast (0 when the survivors agreed).

    .venv/bin/python -m bench.recovery --systems ext --models mlp,big --failures 10 With several models each
(system, model) pair is a series, all interleaved in one run.

Writes bench/results/recovery.json and bench/results/recovery.png (with
other models than mlp alone: recovery_<models>.json / .png).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

from bench import harness
from elastic_ext.testing import launch, ledger


def run_once(system, index, work, model="mlp"):
    out = os.path.join(work, f"{system}-{model}-{index:02d}")
    os.makedirs(out)
    hosts = os.path.join(out, "hosts")
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"])
    cmd = harness.horovodrun(os.path.join(harness.WORKERS, "recovery_worker.py"),
                             ["--system", system, "--out", out, "--model", model], hosts)
    events_path = os.path.join(out, "events.jsonl")
    env = launch.base_env(HOROVOD_FUSION_THRESHOLD=harness.HOROVOD_DEFAULT_FUSION, ELASTIC_EXT_EVENTS_PATH=events_path)
    started = time.time()
    code, _ = launch.run(cmd, env, os.path.join(out, "horovodrun.log"), timeout_s=240)
    with open(os.path.join(out, "kills.jsonl"), encoding="utf-8") as handle:
        kill = json.loads(handle.readline())
    steps = sorted(ledger.read(out), key=lambda r: r["t"])
    after = [s["t"] for s in steps if s["t"] > kill["t"] and s["size"] < 4]
    # elastic_ext only: the state bytes the recovery's sync broadcast (0: the survivors held the commit).
    syncs = []
    if os.path.exists(events_path):
        syncs = [e for e in (json.loads(line) for line in open(events_path) if line.strip())
                 if e["event"] == "sync" and e["time"] > kill["t"]]
    return {"exit_code": code, "wall_s": time.time() - started,
            "recovery_s": after[0] - kill["t"] if after else None,
            "recovery_bytes_broadcast": max((e.get("bytes", 0) for e in syncs), default=None),
            "timeline": [[s["t"] - started, s["size"]] for s in steps if s["rank"] == 0],
            "kill_at": kill["t"] - started}


def summarize(system, runs):
    times = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
    return {"system": system, "failures": len(runs), "recovered": len(times), "recovery_s": times,
            "median_s": statistics.median(times) if times else None, "worst_s": max(times) if times else None,
            "recovery_bytes_broadcast": [r.get("recovery_bytes_broadcast") for r in runs],
            "exit_codes": [r["exit_code"] for r in runs], "timeline": runs[0]["timeline"],
            "kill_at": runs[0]["kill_at"]}


def plot(results, name):
    fig, (ax1, ax2) = harness.pyplot().subplots(1, 2, figsize=(12, 4))
    names = [r["system"] for r in results]
    ax1.bar(names, [r["median_s"] for r in results], label="median")
    ax1.scatter(names, [r["worst_s"] for r in results], color="red", zorder=3, label="worst")
    ax1.set_ylabel("seconds from SIGKILL to first step after recovery")
    ax1.legend()
    for r in results:
        # One dot per completed step: the gap after the SIGKILL is the recovery.
        ax2.plot([t - r["kill_at"] for t, _ in r["timeline"]], [s for _, s in r["timeline"]], marker=".",
                 linestyle="none", label=r["system"])
    ax2.axvline(0, color="red", linestyle="--", label="SIGKILL")
    ax2.set_xlabel("seconds since the SIGKILL (first job of each system)")
    ax2.set_ylabel("world size at each completed step (rank 0)")
    ax2.set_yticks([2, 4])
    ax2.legend()
    harness.save_figure(fig, name)


def replot():
    """Redraws the PNG from the saved JSON (no new measurement)."""
    with open(harness.result_path("recovery.json")) as handle:
        plot(json.load(handle)["results"], "recovery")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=10)
    parser.add_argument("--systems", default="plain,ext")
    parser.add_argument("--models", default="mlp", help="comma-separated: mlp, cnn_bn, big (432 MB with Adam)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_recovery_")
    systems = args.systems.split(",")
    models = args.models.split(",")
    for model in models:
        if model not in ("mlp", "cnn_bn", "big"):
            parser.error(f"model {model!r} must be one of mlp, cnn_bn, big")
    series = [(system, model) for model in models for system in systems]

    def label(system, model):
        return system if models == ["mlp"] else f"{system}/{model}"

    runs = {pair: [] for pair in series}
    for index in range(args.failures):
        for system, model in series:
            runs[system, model].append(run_once(system, index, work, model))
            print(f"{label(system, model)} #{index}: recovery {runs[system, model][-1]['recovery_s']}", flush=True)
    results = [dict(summarize(label(*pair), runs[pair]), model=pair[1]) for pair in series]
    by = {r["system"]: r for r in results}
    command = ".venv/bin/python -m bench.recovery --failures %d" % args.failures
    if args.systems != "plain,ext":
        command += f" --systems {args.systems}"
    if models != ["mlp"]:
        command += f" --models {args.models}"
    summary = {"machine": "2 cores, CPU only, 4 workers on two pseudo-hosts (localhost, 127.0.0.1)",
               "command": command, "results": results, "work_dir": work}
    if "plain" in by and "ext" in by and by["ext"]["median_s"]:
        summary["ratio_median_plain_over_ext"] = by["plain"]["median_s"] / by["ext"]["median_s"]
        summary["ratio_worst_plain_over_ext"] = by["plain"]["worst_s"] / by["ext"]["worst_s"]
    stem = "recovery" if models == ["mlp"] else "recovery_" + "_".join(models)
    harness.write_json(stem, summary, indent=1)
    plot(results, stem)
    print(f"{'system':8s} {'failures':>8s} {'recovered':>9s} {'median s':>9s} {'worst s':>8s}")
    for r in results:
        print(f"{r['system']:8s} {r['failures']:8d} {r['recovered']:9d} {r['median_s'] or float('nan'):9.2f} "
              f"{r['worst_s'] or float('nan'):8.2f}")
    if "ratio_median_plain_over_ext" in summary:
        print(f"plain / elastic_ext: median {summary['ratio_median_plain_over_ext']:.1f}x, "
              f"worst {summary['ratio_worst_plain_over_ext']:.1f}x")


if __name__ == "__main__":
    main()

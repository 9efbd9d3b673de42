"""Time from a worker's SIGKILL to the first completed step after recovery:
plain Horovod elastic, elastic_ext and torchft, side by side in one run.

4 workers on two pseudo-hosts (localhost and 127.0.0.1, 2 slots each). In
each job, rank 3 SIGKILLs itself at step 10 and the job finishes a few steps
later at the smaller size: plain Horovod under ``horovodrun`` blacklists the
killed worker's host and goes on with 2 workers; elastic_ext runs as users
launch it, under ``elastic-horovodrun`` (``--ext-launcher horovodrun`` for
Horovod's launcher), which keeps the host and goes on with 3 (the failed
slot's new worker is still starting when the job ends). ``--failures`` jobs
per system, the systems interleaved, the same worker script under both (see
bench/workers/recovery_worker.py).

    .venv/bin/python -m bench.recovery [--failures 10]
    .venv/bin/python -m bench.recovery --systems ext --models mlp,cnn_bn --failures 5

``--models`` picks the worker's model: ``mlp`` (the default), ``cnn_bn``, a
small CNN with BatchNorm2d whose running statistics differ between ranks, so
the survivors' sync must take them from the root, ``big``, an MLP of
36.5M parameters (437 MB with Adam), or ``table``: the mlp and a 432 MB
table in the State, 4 MB of which each step updates in place, so the state
is large and the step stays the mlp's. With elastic_ext each run also records
the state bytes its recovery broadcast (0 when the survivors agreed), and
splits its recovery time, on the survivors that finish the job, into
``detect_s`` (SIGKILL to their last ``rollback`` event: their in-flight
step's collective failed), ``recover_s`` (to their last ``recovered`` event:
restore, reset, sync) and ``first_step_s`` (to the first completed step),
beside ``step_s_after``, rank 0's median step interval at the new size
(it includes the worker's sleep after each step, 0.05 s, which
``first_step_s`` does not).

    .venv/bin/python -m bench.recovery --systems ext --models mlp,big --failures 10
    .venv/bin/python -m bench.recovery --systems ext --models mlp,table --failures 10

elastic_ext's recoveries are also broken down (``BREAKDOWN``), on the
survivor whose ``recovered`` event comes last, from the fields of its
``rollback``, ``reset`` and ``recovered`` events and the worker's timing of
``hvd.shutdown``/``hvd.init``: ``detection`` (SIGKILL to the failure
reaching the run loop), ``abort`` (cutting the Gloo connections),
``restore`` (the commit; large objects are restored on a thread beside
the next two), ``shutdown`` (Horovod's), ``init`` (``hvd.init``: the
rendezvous with the driver's new round and the Gloo context),
``restore_wait`` (waiting for that thread after the init),
``callbacks`` (the State's reset callbacks), ``learn_connections`` and
``sync`` (``State.sync()``), ``first_step``, and ``other`` (what is left of
the recovery: bookkeeping between those).

``--systems torchft`` (after ``bash tools/setup_bench.sh``) runs the same
loop in torchft (bench/workers/recovery_torchft.py: four replica groups, its
Lighthouse, ``Manager.allreduce``); group 3 kills itself at step 10, its agent
starts it again, and the job ends once the replacement has healed and trained
at 4 groups (``full_size_s``: SIGKILL to that step).

With several models each (system, model) pair is a series, all interleaved in
one run. ``--report-from WORK_DIR`` computes the results again from an
earlier run's job directories (``<system>-<model>-<index>``) without
launching anything; exit codes and wall times are then unknown (None).

Writes bench/results/recovery.json and bench/results/recovery.png (with
other models than mlp alone: recovery_<models>.json / .png; ``--name``
another stem or an absolute path).
"""

import argparse
import glob
import json
import os
import tempfile
import time

from bench import harness, peer_torchft
from elastic_ext.events import read_events
from devkit import launch

PARTS = ("detect_s", "recover_s", "first_step_s", "step_s_after")
BREAKDOWN = ("detection_s", "abort_s", "restore_s", "shutdown_s", "init_s", "restore_wait_s", "callbacks_s",
             "learn_connections_s", "sync_s", "first_step_s", "other_s")
TORCHFT_STEPS_AFTER_FULL = 6  # steps at 4 groups after the replacement healed, then the job ends
TORCHFT_TIMEOUT_S = 240.0
LAUNCHERS = ("elastic-horovodrun", "horovodrun")  # elastic_ext's, the default; Horovod's


def run_torchft(index, work, model):
    """One torchft job (see the module docstring); the same figures as run_once."""
    out = os.path.join(work, f"torchft-{model}-{index:02d}")
    os.makedirs(out)
    launch.write_hosts(os.path.join(out, "hosts"), [])  # read_job's time origin, as for the Horovod jobs
    started = time.time()
    watch = harness.Watch(peer_torchft.launch_jobs(out, ["--out", out, "--model", model], max_restarts=3,
                                                   script="recovery_torchft.py"), out)
    kill_path = os.path.join(out, "kills.jsonl")
    deadline = started + TORCHFT_TIMEOUT_S
    while time.time() < deadline and not os.path.exists(kill_path):
        watch.idle_until(time.time() + 0.5)
    if os.path.exists(kill_path):
        killed = os.path.getmtime(kill_path)
        full, _ = watch.wait_for(lambda r: r["t"] > killed and r["size"] == 4, max(1.0, deadline - time.time()))
        if full is not None:
            watch.wait_for(lambda r: r["t"] > killed and r["size"] == 4 and r["step"] >= full["step"]
                           + TORCHFT_STEPS_AFTER_FULL, max(1.0, deadline - time.time()))
    launch.write_hosts(os.path.join(out, "stop"), ["stop"])
    codes = watch.stop(30)
    return {"exit_code": codes[0][0], "wall_s": time.time() - started,
            **measure(out, started)}


def run_once(system, index, work, model="mlp", launcher=LAUNCHERS[0]):
    out = os.path.join(work, f"{system}-{model}-{index:02d}")
    os.makedirs(out)
    hosts = os.path.join(out, "hosts")
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"])
    cmd = harness.horovodrun(os.path.join(harness.WORKERS, "recovery_worker.py"),
                             ["--system", system, "--out", out, "--model", model], hosts)
    if system == "ext" and launcher == "elastic-horovodrun":
        cmd = launch.under_elastic_ext_driver(cmd)
    events_path = os.path.join(out, "events.jsonl")
    env = launch.base_env(HOROVOD_FUSION_THRESHOLD=harness.HOROVOD_DEFAULT_FUSION, ELASTIC_EXT_EVENTS_PATH=events_path)
    started = time.time()
    code, _ = launch.run(cmd, env, os.path.join(out, "horovodrun.log"), timeout_s=240)
    return {"exit_code": code, "wall_s": time.time() - started, **measure(out, started)}


def read_job(out):
    """A finished job's figures from its directory alone (exit code and wall time unknown);
    its timeline counts from the host file's writing, just before the launch."""
    return {"exit_code": None, "wall_s": None, **measure(out, os.path.getmtime(os.path.join(out, "hosts")))}


def read_jsonl(path):
    """The records of a worker's JSON-lines file; a line cut by a SIGKILL is skipped."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_steps(out):
    """Every worker's completed steps, each with the pid its file ``steps-<pid>.jsonl`` names."""
    return [dict(record, pid=harness.writer_pid(path))
            for path in glob.glob(os.path.join(out, "steps-*.jsonl")) for record in read_jsonl(path)]


def measure(out, started):
    """One finished job's figures; ``started``: where its timeline's seconds count from."""
    if not os.path.exists(os.path.join(out, "kills.jsonl")):  # the job never reached its failure
        return {"recovery_s": None, "recovery_bytes_broadcast": None, "full_size_s": None, "timeline": [],
                "kill_at": None, **{part: None for part in PARTS + BREAKDOWN}}
    with open(os.path.join(out, "kills.jsonl"), encoding="utf-8") as handle:
        kill = json.loads(handle.readline())
    steps = sorted(read_steps(out), key=lambda r: r["t"])
    torchft = os.path.basename(out).startswith("torchft-")
    # Horovod: the survivors' steps at 2 workers (a rollback may repeat step numbers). torchft never rolls
    # back and its replacement may be back before the survivors' quorum: any later step.
    after = [s for s in steps if s["t"] > kill["t"] and (s["step"] > kill["step"] if torchft else s["size"] < 4)]
    full = next((s for s in after if s["size"] == 4), None)
    # elastic_ext only (plain Horovod writes no events). The failure's recovery: its events up to the
    # survivors' first step, not those of the slot's new worker joining later (at the latest at the end).
    events_path = os.path.join(out, "events.jsonl")
    until = after[0]["t"] if after else float("inf")
    events = [e for e in read_events(events_path) if kill["t"] < e["time"] <= until] \
        if os.path.exists(events_path) else []
    # The state bytes the recovery's sync broadcast (0: the survivors held the commit).
    syncs = [e for e in events if e["event"] == "sync"]
    return {"recovery_s": after[0]["t"] - kill["t"] if after else None,
            "recovery_bytes_broadcast": max((e.get("bytes", 0) for e in syncs), default=None),
            "full_size_s": full["t"] - kill["t"] if full else None,
            **split_recovery(kill["t"], after, events),
            **breakdown(kill["t"], after, events, read_calls(out)),
            "timeline": [[s["t"] - started, s["size"]] for s in steps if s["rank"] == 0],
            "kill_at": kill["t"] - started}


def split_recovery(kill_t, after, events):
    """recovery_s in three consecutive parts, on the survivors that finish the job (None where an
    event is missing), and step_s_after: rank 0's median step interval at the new size."""
    survivors = {s["pid"] for s in after}
    detected = last_event(events, "rollback", survivors)
    recovered = last_event(events, "recovered", survivors)
    first = after[0]["t"] if after else None
    times = [s["t"] for s in after if s["rank"] == 0]
    return {"detect_s": gap(kill_t, detected), "recover_s": gap(detected, recovered),
            "first_step_s": gap(recovered, first),
            "step_s_after": harness.median([b - a for a, b in zip(times, times[1:])])}


def read_calls(out):
    """The worker's timing of hvd.init / hvd.shutdown calls (recovery_worker.py)."""
    return [record for path in glob.glob(os.path.join(out, "calls-*.jsonl")) for record in read_jsonl(path)]


def breakdown(kill_t, after, events, calls):
    """elastic_ext's recovery in consecutive parts (``BREAKDOWN``), on the survivor whose ``recovered``
    event came last; every part None when an event or field is missing (plain Horovod, torchft)."""
    empty = {part: None for part in BREAKDOWN}
    recovered = [e for e in events if e["event"] == "recovered" and "sync_s" in e]
    if not recovered or not after:
        return empty
    last = max(recovered, key=lambda e: e["time"])
    pid = last["pid"]
    rollback = next((e for e in events if e["event"] == "rollback" and e.get("pid") == pid and "failed_at" in e), None)
    reset = next((e for e in events if e["event"] == "reset" and e.get("pid") == pid and "reinit_s" in e), None)
    mine = sorted((c for c in calls if c["pid"] == pid and c["start"] > kill_t), key=lambda c: c["start"])
    shutdown = next((c for c in mine if c["call"] == "shutdown"), None)
    init = next((c for c in mine if c["call"] == "init"), None)
    if rollback is None or reset is None or shutdown is None or init is None:
        return empty
    parts = {"detection_s": rollback["failed_at"] - kill_t, "abort_s": rollback["abort_s"],
             "restore_s": rollback["restore_s"], "shutdown_s": shutdown["end"] - shutdown["start"],
             "init_s": init["end"] - init["start"], "restore_wait_s": reset.get("restore_wait_s", 0.0),
             "callbacks_s": reset["callbacks_s"],
             "learn_connections_s": last["learn_connections_s"], "sync_s": last["sync_s"],
             "first_step_s": after[0]["t"] - last["time"]}
    parts["other_s"] = after[0]["t"] - kill_t - sum(parts.values())
    return parts


def last_event(events, name, pids):
    return max((e["time"] for e in events if e["event"] == name and e.get("pid") in pids), default=None)


def gap(start, end):
    return None if start is None or end is None else end - start


def summarize(system, runs):
    times = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
    return {"system": system, "failures": len(runs), "recovered": len(times), "recovery_s": times,
            "median_s": harness.median(times), "worst_s": max(times) if times else None,
            "recovery_bytes_broadcast": [r.get("recovery_bytes_broadcast") for r in runs],
            "exit_codes": [r["exit_code"] for r in runs], "timeline": runs[0]["timeline"],
            "kill_at": runs[0]["kill_at"],
            "full_size_s": [r.get("full_size_s") for r in runs],
            "median_full_size_s": harness.median([r["full_size_s"] for r in runs if r.get("full_size_s") is not None]),
            **{part: [r[part] for r in runs] for part in PARTS},
            **{f"median_{part}": harness.median([r[part] for r in runs if r[part] is not None]) for part in PARTS},
            "breakdown": {part: [r.get(part) for r in runs] for part in BREAKDOWN},
            "median_breakdown": {part: harness.median([r[part] for r in runs if r.get(part) is not None])
                                 for part in BREAKDOWN}}


def describe(run):
    """One run's recovery and its parts, as printed."""
    f = harness.fmt
    return (f"recovery {f(run['recovery_s'])} s = detect {f(run['detect_s'])} + recover {f(run['recover_s'])} "
            f"+ first step {f(run['first_step_s'])} (steps of {f(run['step_s_after'])} s after)")


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


def launch_all(series, failures, work, label, launcher):
    """``failures`` jobs per (system, model) pair, the pairs interleaved."""
    runs = {pair: [] for pair in series}
    for index in range(failures):
        for system, model in series:
            run = run_torchft(index, work, model) if system == "torchft" else run_once(system, index, work, model, launcher)
            runs[system, model].append(run)
            print(f"{label(system, model)} #{index}: {describe(runs[system, model][-1])}", flush=True)
    return runs


def read_all(series, work, label):
    """Each pair's runs from the job directories ``<system>-<model>-<index>`` of ``work``, in index order."""
    names = [name for name in os.listdir(work) if name.count("-") == 2]
    runs = {}
    for system, model in series:
        jobs = sorted((int(name.split("-")[2]), name) for name in names if name.startswith(f"{system}-{model}-"))
        if not jobs:
            raise SystemExit(f"no job directory {system}-{model}-<index> in {work}")
        runs[system, model] = [read_job(os.path.join(work, name)) for _, name in jobs]
        for (index, _), run in zip(jobs, runs[system, model]):
            print(f"{label(system, model)} #{index}: {describe(run)}", flush=True)
    return runs


def print_summary(results):
    print(harness.table(["system", "failures", "recovered", "median s", "worst s", "detect s", "recover s",
                         "first step s", "step s after", "back to 4 s"],
                        [[r["system"], r["failures"], r["recovered"], r["median_s"], r["worst_s"],
                          *(r[f"median_{part}"] for part in PARTS), r["median_full_size_s"]] for r in results]))
    shown = [r for r in results if any(v is not None for v in r["median_breakdown"].values())]
    if shown:
        print("recovery breakdown (medians, s):")
        print(harness.table(["system"] + [part[:-2] for part in BREAKDOWN],
                            [[r["system"], *r["median_breakdown"].values()] for r in shown]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=10, help="jobs per series (not with --report-from)")
    parser.add_argument("--systems", default="plain,ext")
    parser.add_argument("--models", default="mlp", help="comma-separated: mlp, cnn_bn, big (437 MB with Adam), "
                                                             "table (the mlp and a 432 MB table)")
    parser.add_argument("--report-from", metavar="WORK_DIR",
                        help="compute the results from this earlier run's job directories, launching nothing")
    parser.add_argument("--ext-launcher", choices=LAUNCHERS, default=LAUNCHERS[0],
                        help="what launches the ext jobs (plain Horovod's always run under horovodrun)")
    parser.add_argument("--name", help="result file stem under bench/results, or an absolute path without "
                                       "extension (default: recovery, or recovery_<models>)")
    args = parser.parse_args()
    systems = args.systems.split(",")
    models = args.models.split(",")
    for model in models:
        if model not in ("mlp", "cnn_bn", "big", "table"):
            parser.error(f"model {model!r} must be one of mlp, cnn_bn, big, table")
        if model in ("cnn_bn", "table") and "torchft" in systems:
            parser.error(f"the torchft worker has no {model} model (mlp, big)")
    for system in systems:
        if system not in ("plain", "ext", "torchft"):
            parser.error(f"system {system!r} must be one of plain, ext, torchft")
    series = [(system, model) for model in models for system in systems]

    def label(system, model):
        return system if models == ["mlp"] else f"{system}/{model}"

    if args.report_from:
        work = os.path.abspath(args.report_from)
        runs = read_all(series, work, label)
    else:
        work = tempfile.mkdtemp(prefix="bench_recovery_")
        runs = launch_all(series, args.failures, work, label, args.ext_launcher)
    results = [dict(summarize(label(*pair), runs[pair]), model=pair[1]) for pair in series]
    by = {r["system"]: r for r in results}
    command = ".venv/bin/python -m bench.recovery --failures %d" % max(len(r) for r in runs.values())
    if args.systems != "plain,ext":
        command += f" --systems {args.systems}"
    if models != ["mlp"]:
        command += f" --models {args.models}"
    if args.ext_launcher != LAUNCHERS[0]:
        command += f" --ext-launcher {args.ext_launcher}"
    summary = {"machine": "2 cores, CPU only, 4 workers on two pseudo-hosts (localhost, 127.0.0.1)",
               "command": command, "ext_launcher": args.ext_launcher, "results": results, "work_dir": work}
    if args.report_from:
        summary["report_from"] = work
    if "plain" in by and "ext" in by and by["ext"]["median_s"]:
        summary["ratio_median_plain_over_ext"] = by["plain"]["median_s"] / by["ext"]["median_s"]
        summary["ratio_worst_plain_over_ext"] = by["plain"]["worst_s"] / by["ext"]["worst_s"]
    small = by.get("ext/mlp")
    for big in ("big", "table"):  # a large state's recovery against the 10 KB one's
        large = by.get(f"ext/{big}")
        if small and large:
            summary[f"ratio_{big}_over_mlp"] = {key: large[key] / small[key] for key in
                                                ("median_s", *(f"median_{part}" for part in PARTS))
                                                if large[key] is not None and small[key]}
    stem = args.name or ("recovery" if models == ["mlp"] else "recovery_" + "_".join(models))
    harness.write_json(stem, summary, indent=1)
    plot(results, stem)
    print_summary(results)
    for big in ("big", "table"):
        if f"ratio_{big}_over_mlp" in summary:
            print(f"{big} / mlp: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary[f"ratio_{big}_over_mlp"].items()))
    if "ratio_median_plain_over_ext" in summary:
        print(f"plain / elastic_ext: median {summary['ratio_median_plain_over_ext']:.1f}x, "
              f"worst {summary['ratio_worst_plain_over_ext']:.1f}x")


if __name__ == "__main__":
    main()

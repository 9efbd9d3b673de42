"""A survivor stuck on a send Gloo never wakes, with elastic_ext's closed-links watch and without it.

Three workers, one per pseudo-host, under ``elastic-horovodrun``, train a
Keras 3 model whose 16.8 MB of gradients go through one ring allreduce per
step (bench/workers/stuck_send_worker.py). Once the job has trained
``--warmup-steps`` steps, one worker, chosen and timed by the trial's seed
(the same for both modes), is SIGKILLed; the two survivors must go on
without it. Gloo (as Horovod 0.28.1 builds it) does not wake a send queued
on the failed connection: a survivor caught so waits for Gloo's timeout
(120 s in the job's first round, elastic_ext's ``rendezvous_timeout_s``),
the other waits for it in the next round. With the watch
(:mod:`elastic_ext.runtime.closed_links`) that survivor kills itself 10 s
into the wait and the job goes on with one worker. Reported per mode:
the time from the SIGKILL until a survivor completes a step again (the job
trains again), how many trials a survivor stalled (nothing trained for more
than 30 s) and how many workers the watch ended (``links_closed`` events).

    .venv/bin/python -m bench.stuck_send [--trials 8]

Writes bench/results/stuck_send.json.
"""

import argparse
import glob
import json
import os
import random
import tempfile
import time

from bench import harness
from elastic_ext.events import read_events
from devkit import launch

WORKER = os.path.join(harness.WORKERS, "stuck_send_worker.py")
STALLED_S = 30.0
WAIT_S = 180.0


def trial(work: str, number: int, watch: bool, args: argparse.Namespace) -> dict:
    out = os.path.join(work, f"{'watch' if watch else 'no-watch'}-{number}")
    os.makedirs(out)
    hosts = os.path.join(out, "hosts")
    names = harness.local_host_names()[:3]
    launch.write_hosts(hosts, [f"{name}:1" for name in names])
    cmd = launch.under_elastic_ext_driver(harness.horovodrun(
        WORKER, ["--out", out, "--steps", str(args.steps)] + ([] if watch else ["--no-watch"]), hosts, np_=3,
        min_np=1, max_np=3))
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                          HOROVOD_FUSION_THRESHOLD=harness.HOROVOD_DEFAULT_FUSION)
    job = launch.Job(cmd, env, os.path.join(out, "horovodrun.log"))
    seen = harness.Watch([job], out)
    result = {"mode": "watch" if watch else "no-watch", "trial": number}
    try:
        first, why = seen.wait_for(lambda r: r["size"] == 3 and r["step"] >= args.warmup_steps, WAIT_S)
        if first is None:
            result["error"] = f"no step {args.warmup_steps} at 3 workers: {why}"
            return result
        seen.idle_until(time.time() + random.Random(number).uniform(0, 0.5))
        victim = victim_pid(out, number)
        killed_at = seen.kill(victim) if victim else None
        if killed_at is None:
            result["error"] = "not three workers to choose from"
            return result
        after, why = seen.wait_for(lambda r: r["t"] > killed_at + 0.001 and r["size"] < 3, WAIT_S)
        result["trains_again_s"] = None if after is None else round(after["t"] - killed_at, 3)
        result["why_not"] = why or None
    finally:
        job.kill()  # measured (or failed): the job would train on to --steps
    events = read_events(os.path.join(out, "events.jsonl"))
    result["links_closed"] = len([e for e in events if e["event"] == "links_closed"])
    result["stalled"] = result.get("trains_again_s") is None or result["trains_again_s"] > STALLED_S
    return result


def victim_pid(out: str, number: int) -> int:
    """One of the three workers (by their steps files), chosen by the trial's seed; 0 if not three."""
    writers = sorted(harness.writer_pid(p) for p in glob.glob(os.path.join(out, "steps-*.jsonl")))
    return random.Random(number).choice(writers) if len(writers) == 3 else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8, help="trials per mode, the modes interleaved")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100000, help="the job's length (it is stopped earlier)")
    parser.add_argument("--name", default="stuck_send")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_stuck_send_")
    results = []
    for number in range(args.trials):
        for watch in (True, False):
            results.append(trial(work, number, watch, args))
            print(json.dumps(results[-1]), flush=True)
    summary = {}
    for mode in ("watch", "no-watch"):
        rows = [r for r in results if r["mode"] == mode and "error" not in r]
        again = [r["trains_again_s"] for r in rows if r.get("trains_again_s") is not None]
        summary[mode] = {"trials": len(rows), "stalled": sum(r["stalled"] for r in rows),
                         "links_closed": sum(r["links_closed"] for r in rows),
                         "trains_again_median_s": harness.median(again), "trains_again_worst_s": max(again or [None])}
    print(harness.table(["", "watch", "no-watch"],
                        [[key, summary["watch"][key], summary["no-watch"][key]] for key in summary["watch"]]))
    print(f"logs in {work}")
    harness.write_json(args.name, {"machine": harness.machine(), "command": "python -m bench.stuck_send "
                                   f"--trials {args.trials}", "summary": summary, "trials": results})


if __name__ == "__main__":
    main()

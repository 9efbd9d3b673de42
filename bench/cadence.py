"""Training lost and time to finish under one schedule of job deaths: ``checkpoint_every="auto"`` vs fixed cadences.

Run from the repository root: ``.venv/bin/python -m bench.cadence``.

One training job (an MLP with Adam, a single process with
``elastic_ext.testing.SoloBinding``, a commit per step, durable checkpoints
in a local directory) must reach ``--steps`` steps. A seeded schedule of
whole-job deaths (exponential gaps of mean ``--mtbf-s``, the same times for
every cadence) SIGKILLs the process; a new one resumes from the newest
checkpoint, as a supervisor or a requeue would. Each cadence runs the same
job under the same schedule, in turn, in one run:

- ``steps_lost``: steps computed twice (after a death, from the newest
  checkpoint to where the dead process was);
- ``step_s``: the median step, slowed by the background writes;
- ``wall_s``: from the first start to the last step, restarts included:
  what the cadence costs in all (writes plus lost work);
- ``checkpoints`` written, ``deaths`` met, and for ``auto`` the cadences it
  chose (its ``checkpoint_cadence`` events).

Every figure is reported as a ratio to ``auto``. Writes
``bench/results/cadence.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from bench import harness


def child(args: argparse.Namespace) -> None:
    """One process of the job: resume, train to ``--steps`` (a JSON line per step), wait for the last write."""
    import torch

    from bench.models import mlp
    from elastic_ext.config import ElasticConfig
    from elastic_ext.testing import SoloBinding, state_on

    torch.set_num_threads(args.threads)
    model = mlp([args.width] * (args.layers + 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    every = args.every if args.every == "auto" else int(args.every)
    config = ElasticConfig(checkpoint_dir=os.path.join(args.dir, "ckpt"), checkpoint_every=every,
                           checkpoint_keep_last=2, events_path=os.path.join(args.dir, "events.jsonl"))
    state = state_on(SoloBinding(), config=config, model=model, optimizer=optimizer, step=0)
    state.sync()  # the newest checkpoint, if any
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    with open(os.path.join(args.dir, "steps.jsonl"), "a", encoding="utf-8") as log:
        while state.step < args.steps:
            started = time.perf_counter()
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            state.commit()
            log.write(json.dumps({"step": state.step, "s": time.perf_counter() - started, "pid": os.getpid(),
                                  "t": time.time()}) + "\n")
            log.flush()
    state.wait_for_checkpoint()


def deaths(seed: int, mtbf_s: float, horizon_s: float) -> List[float]:
    """Seconds after the start at which the job dies: exponential gaps of mean ``mtbf_s``, up to ``horizon_s``."""
    rng, times, now = random.Random(seed), [], 0.0
    while True:
        now += rng.expovariate(1.0 / mtbf_s)
        if now > horizon_s:
            return times
        times.append(now)


def run_cadence(every: str, schedule: List[float], args: argparse.Namespace, root: str) -> Dict[str, Any]:
    """The job under ``schedule`` with ``checkpoint_every=every``; its figures."""
    work = os.path.join(root, f"every_{every}")
    os.makedirs(work)
    cmd = [sys.executable, "-m", "bench.cadence", "--child", "--dir", work, "--every", every,
           "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
           "--batch", str(args.batch), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=harness.REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started, met, pending = time.monotonic(), 0, list(schedule)
    while True:
        proc = subprocess.Popen(cmd, env=env, cwd=harness.REPO_ROOT, stdin=subprocess.DEVNULL)
        while proc.poll() is None:
            if pending and time.monotonic() - started >= pending[0]:
                pending.pop(0)
                proc.send_signal(signal.SIGKILL)  # the whole job dies: every host at once
                met += 1
            elif time.monotonic() - started > args.timeout_s:
                proc.kill()
                raise RuntimeError(f"checkpoint_every={every} did not finish within {args.timeout_s}s")
            time.sleep(0.02)
        proc.wait()
        if proc.returncode == 0:
            break
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"checkpoint_every={every}: a process ended with {proc.returncode}")
    wall = time.monotonic() - started
    with open(os.path.join(work, "steps.jsonl"), encoding="utf-8") as handle:
        steps = [json.loads(line) for line in handle if line.strip()]
    with open(os.path.join(work, "events.jsonl"), encoding="utf-8") as handle:
        events = [json.loads(line) for line in handle if line.strip()]
    cadences = [(e["commit_id"], e["every"], round(e["interval_s"], 2), round(e["write_cost_s"], 4),
                 round(e["mtbf_s"], 1), e["reason"]) for e in events if e["event"] == "checkpoint_cadence"]
    writes = [e for e in events if e["event"] == "checkpoint"]
    return {"every": every, "wall_s": wall, "deaths": met, "steps_computed": len(steps),
            "steps_lost": len(steps) - args.steps, "step_s": statistics.median(s["s"] for s in steps),
            "checkpoints": len(writes), "write_s": statistics.median(e["duration_s"] for e in writes),
            "cadences": cadences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="steps the job must reach (a commit per step)")
    parser.add_argument("--mtbf-s", type=float, default=20.0, help="mean time between job deaths")
    parser.add_argument("--cadences", default="auto,1,10,100", help="checkpoint_every values, comma-separated")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="(width x width layers: 3 x 4 B each with Adam)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: every core trains, so a write competes with training)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per cadence")
    parser.add_argument("--name", default="cadence", help="result file stem under bench/results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--every", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    schedule = deaths(args.seed, args.mtbf_s, args.timeout_s)
    root = tempfile.mkdtemp(prefix="elastic_ext_bench_cadence_")
    try:
        runs = []
        for every in args.cadences.split(","):
            runs.append(run_cadence(every.strip(), schedule, args, root))
            last = runs[-1]
            print(f"checkpoint_every={last['every']}: {last['wall_s']:.1f}s, {last['deaths']} deaths, "
                  f"{last['steps_lost']} steps lost, {last['checkpoints']} checkpoints", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    auto = next((r for r in runs if r["every"] == "auto"), runs[0])
    for run in runs:
        run["ratio_wall_to_auto"] = harness.ratio(run["wall_s"], auto["wall_s"])
        run["ratio_steps_lost_to_auto"] = harness.ratio(run["steps_lost"], auto["steps_lost"])
        run["ratio_step_s_to_auto"] = harness.ratio(run["step_s"], auto["step_s"])
    state_mib = 3 * 4 * args.layers * (args.width * args.width + args.width) / 2**20
    result = {"benchmark": "cadence", "what": __doc__.split("\n")[0], "steps": args.steps, "mtbf_s": args.mtbf_s,
              "schedule_s": schedule, "state_mib": state_mib, "threads": args.threads,
              "machine": dict(harness.machine(), load_average_at_end=list(os.getloadavg())), "runs": runs}
    path = harness.write_json(args.name, result)
    print(f"\n{args.steps} steps, {state_mib:.0f} MiB of state, job deaths every {args.mtbf_s:g}s on average "
          f"(seed {args.seed})")
    print(harness.table(["checkpoint_every", "wall s", "x auto", "steps lost", "x auto", "step s", "x auto",
                         "checkpoints", "deaths"],
                        [[r["every"], r["wall_s"], r["ratio_wall_to_auto"], r["steps_lost"],
                          r["ratio_steps_lost_to_auto"], r["step_s"], r["ratio_step_s_to_auto"], r["checkpoints"],
                          r["deaths"]] for r in runs]))
    print("auto's cadences (commit, every, interval s, write cost s, mtbf s, why):", auto["cadences"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The price of keeping the last agreed commit (the replica check's replay), side by side with the check off.

With the replica check on, each rank keeps a copy of the last commit on which every rank agreed
(``elastic_ext/state/agreed.py``), so that a mismatch can be replayed from it. Measured here, in a
world of one (``SoloBinding``: the keep is a local copy, no collective is involved), for a State
holding a ``--state-mb`` MB model whose every page a step writes (a dense model under an optimizer):

- host memory: the resident set after a sync and ``--commits`` commits, each arm in a fresh process,
  with ``replica_check_every`` 0 (off) and at the default cadence; the difference per GB of state;
- time per commit: the mean over ``--commits`` commits (the keep's copy runs at every agreed check,
  one commit in ``replica_check_every``), check on over off, in the same fresh processes;
- what a flip costs: the replay goes back to the last agreed commit whatever step the flip hit, so it
  retrains every step between that commit and the check that found it: ``replica_check_every`` x the
  commit interval (fewer when a sync came in between), at the job's own step time.

The per-step cost in a real job (4 workers under ``elastic-horovodrun``, the check's digest, its
blocking collective and this copy together) is ``bench.replica_check``'s.

    .venv/bin/python -m bench.replica_keep [--state-mb 1024] [--commits 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict

from bench import harness


def one_arm(every: int, state_mb: int, commits: int) -> Dict[str, Any]:
    """In this (fresh) process: RSS and commit times of a State of ``state_mb`` MB, check every ``every``."""
    import torch

    from elastic_ext import ElasticConfig
    from elastic_ext.testing import SoloBinding, state_on

    torch.set_num_threads(1)
    before = harness.settled_rss()
    rows = state_mb * (1 << 20) // 4 // 1024
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(rows // 8, 1024)) for _ in range(8)])
    state_bytes = sum(p.numel() * 4 for p in model)
    state = state_on(SoloBinding(), config=ElasticConfig(replica_check_every=every), model=model, step=0)
    state.sync()
    seconds = []
    for _ in range(commits):
        with torch.no_grad():
            for p in model:
                p.add_(1.0)  # a step writes every page, as an optimizer does to a dense model
        state.step += 1
        started = time.perf_counter()
        state.commit()
        seconds.append(time.perf_counter() - started)
    kept = state._replica.agreed.entries
    return {"every": every, "state_bytes": state_bytes, "rss_bytes": harness.settled_rss() - before,
            "kept_bytes": sum(a.nbytes for e in (kept or {}).values() for a in e.arrays.values()),
            "commit_s_mean": sum(seconds) / len(seconds), "commit_s": harness.summary(seconds)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=1024)
    parser.add_argument("--commits", type=int, default=40)
    parser.add_argument("--commit-every", type=int, default=10, help="steps per commit, for the replay's cost")
    parser.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # the child's own run
    parser.add_argument("--name", default="replica_keep", help="result file stem under bench/results")
    args = parser.parse_args(argv)
    if args.arm is not None:
        print(json.dumps(one_arm(args.arm, args.state_mb, args.commits)))
        return 0
    from elastic_ext import ElasticConfig

    default = ElasticConfig().replica_check_every
    child = ["--state-mb", str(args.state_mb), "--commits", str(args.commits), "--arm"]
    runs = {0: [], default: []}
    for every in (0, default, default, 0):  # A B B A
        runs[every].append(harness.run_child("bench.replica_keep", child + [str(every)], timeout_s=900))
    off, on = runs[0], runs[default]
    gb = off[0]["state_bytes"] / 1e9
    rss = {every: harness.median([r["rss_bytes"] for r in arm]) for every, arm in runs.items()}
    commit = {every: harness.median([r["commit_s_mean"] for r in arm]) for every, arm in runs.items()}
    replayed = default * args.commit_every
    ratios = {"host_memory_more_per_gb_of_state": (rss[default] - rss[0]) / 1e9 / gb,
              "kept_bytes_per_state_byte": on[0]["kept_bytes"] / on[0]["state_bytes"],
              "commit_time_on_over_off": harness.ratio(commit[default], commit[0])}
    result = harness.machine(default_every=default, state_mb=args.state_mb, commits=args.commits, runs=runs,
                             rss_bytes=rss, commit_s_mean=commit, ratios=ratios,
                             replay_steps={"per_flip": replayed, "commit_every": args.commit_every},
                             command="python -m bench.replica_keep " + " ".join(sys.argv[1:]))
    print(harness.table(["replica check", "RSS over the model (MB)", "kept (MB)", "commit mean (ms)", "runs"],
                        [["off" if every == 0 else f"every {every}", (rss[every] - arm[0]["state_bytes"]) / 1e6,
                          arm[0]["kept_bytes"] / 1e6, 1000 * commit[every], len(arm)]
                         for every, arm in runs.items()]))
    print(ratios)
    print("wrote", harness.write_json(args.name, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

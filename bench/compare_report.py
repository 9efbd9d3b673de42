"""bench.compare's reading of its jobs: step logs to figures, ratios, plots and the table.

What bench/compare.py measures, computed from what its workers wrote (the
step log format is in bench/workers/compare_common.py) and from the driver's
own record of each attempt (``failures``, ``first_full``, ``problems``):
time to resume and back to full size per failure (from the SIGKILL, and
from the start of the first process begun after it: the replacement),
steps lost, steps and per-rank batches discarded, goodput over the
committed history, throughput at full size, commit cost, and the
exactly-once audit of the committed history (torchft's committed history is
read by bench/peer_torchft.py: it commits or discards each step on its own).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Any, Dict, List, Optional

from bench import harness, peer_torchft
from bench.harness import median
from bench.workers.compare_common import DATASET_SIZE
from devkit import ledger

LABELS = {"plain": "plain Horovod", "torchrun": "torchrun", "ext": "elastic_ext",
          "ext_horovodrun": "elastic_ext, plain horovodrun", "torchft": "torchft", "torchft_ddp": "torchft, DDP"}
WORKERS_PER_JOB = 4
WARMUP_S = 1.0  # throughput stretches start this long after the job is at 4 workers
GEN_STRIDE = 10 ** 19  # generation ids of attempt a become a * GEN_STRIDE + id (ids are < 2**63)
# Ratios in elastic_ext's favour: metric -> (result field, lower is better).
METRICS = {"resume_median": ("resume_median_s", True), "resume_worst": ("resume_worst_s", True),
           "full_size_median": ("full_size_median_s", True), "steps_lost_mean": ("steps_lost_mean", True),
           "goodput": ("goodput_samples_per_s", False), "throughput_no_failure": ("throughput_samples_per_s", False),
           "commit_per_step": ("commit_per_step_s", True)}


def combined_records(attempts: List[Any]) -> List[dict]:
    """Every attempt's records, generation ids made unique across attempts (attempt a first)."""
    records = []
    for index, run in enumerate(attempts):
        for record in ledger.read(run.log_dir):
            if "gen" in record:
                record["gen"] = index * GEN_STRIDE + record["gen"]
            if "g" in record:
                record["g"] = index * GEN_STRIDE + record["g"]
            if "start" in record:
                record["start"] = index * GEN_STRIDE + record["start"]
            record["attempt"] = index
            records.append(record)
    return records


def audit(records: List[dict], epochs: int, history: Optional[List[dict]] = None) -> Dict[str, Any]:
    """``ledger.audit`` of the first ``epochs`` (complete) epochs, in the fields compare.json keeps.

    Returns ``{"epochs": [{"epoch", "processed", "duplicated", "missing"}],
    "duplicated", "missing"}``: samples seen twice and never in the committed
    history, per epoch and in all.
    """
    checked = ledger.audit(records, DATASET_SIZE, epochs, history)
    rows = [{key: row[key] for key in ("epoch", "processed", "duplicated", "missing")} for row in checked["epochs"]]
    return {"epochs": rows, "duplicated": sum(r["duplicated"] for r in rows),
            "missing": sum(r["missing"] for r in rows)}


def throughput(steps: List[dict], stretches: List[tuple]) -> Dict[str, Any]:
    """All ranks' samples per second over the given (from, to) stretches, at 4 workers only.

    ``steps`` are "done" records (completed steps), sorted by time.
    """
    samples_total, seconds, step_count, windows = 0, 0.0, 0, []
    for begin, end in stretches:
        ticks = [r["t"] for r in steps if begin + WARMUP_S <= r["t"] < end and r["rank"] == 0
                 and r["size"] == WORKERS_PER_JOB]
        if len(ticks) < 3:
            continue
        samples = sum(r["n"] for r in steps if ticks[0] < r["t"] <= ticks[-1] + 0.05 and r["size"] == WORKERS_PER_JOB)
        samples_total += samples
        seconds += ticks[-1] - ticks[0]
        step_count += len(ticks) - 1
        windows.append({"from": begin, "to": end, "samples_per_s": samples / (ticks[-1] - ticks[0])})
    return {"samples_per_s": samples_total / seconds if seconds else None,
            "step_time_s": seconds / step_count if step_count else None, "windows": windows}


def analyze(system: str, attempts: List[Any]) -> Dict[str, Any]:
    records = combined_records(attempts)
    steps = sorted((r for r in records if "done" in r), key=lambda r: r["t"])  # completed steps
    begun: Dict[int, dict] = {}
    for r in sorted((r for r in records if "start" in r), key=lambda r: r["t"]):
        begun.setdefault(r["start"], r)
    result: Dict[str, Any] = {
        "system": system, "label": LABELS[system],
        "attempts": [{"launched_s": run.launched - attempts[0].launched, "wall_s": run.ended - run.launched,
                      "exit_codes": run.exit_codes, "problems": run.problems, "failures": len(run.failures),
                      "log_dir": run.log_dir} for run in attempts],
    }
    if not steps:
        result["problems"] = ["no step completed"]
        return result
    t0, t_end = steps[0]["t"], steps[-1]["t"]
    rank0 = [r for r in steps if r["rank"] == 0]

    failures: List[Dict[str, Any]] = []
    stretches = []  # (from, to) at 4 workers, for the throughput between failures
    for index, run in enumerate(attempts):
        begin = run.first_full
        for f in run.failures:
            gen = index * GEN_STRIDE + f["gen"]
            item: Dict[str, Any] = {"number": f["number"], "attempt": index, "at_s": f["killed_at"] - t0,
                                    "killed_rank": f["rank"], "job_died": "resumed_at" not in f}
            if begin is not None:
                stretches.append((begin, f["killed_at"]))
            after = [r for r in steps if r["g"] != gen and r["t"] > f["killed_at"]]
            if after:
                # After a job died, "after" is the relaunched job: its first step, from where it started.
                reached = max(r["done"] for r in steps if r["g"] == gen) + 1
                resumed_from = begun[after[0]["g"]]["step"]
                item.update(resume_s=after[0]["t"] - f["killed_at"], resumed_at_s=after[0]["t"] - t0,
                            world_after=after[0]["size"], steps_done_before=reached,
                            resumed_from_step=resumed_from, steps_lost=reached - resumed_from)
                full = next((r for r in after if r["size"] == WORKERS_PER_JOB), None)
                if full is not None:
                    item.update(full_size_s=full["t"] - f["killed_at"], full_at_s=full["t"] - t0)
            created = [r["created"] for r in records if "proc" in r and r["created"] > f["killed_at"]]
            if created and "full_at_s" in item:
                # The first process begun after the SIGKILL: the replacement (torchrun: every restarted worker).
                item.update(replacement_started_s=min(created) - f["killed_at"],
                            full_size_after_replacement_s=item["full_at_s"] + t0 - min(created))
            if "host_added_at" in f:
                item.update(host_added=f["host_added"], host_added_at_s=f["host_added_at"] - t0)
                if "full_at" in f:
                    small = [r["t"] for r in rank0 if f["killed_at"] < r["t"] <= f["full_at"]
                             and r["size"] < WORKERS_PER_JOB]
                    item.update(steps_on_survivors=len(small),
                                regrow_stall_s=f["full_at"] - (small[-1] if small else f["killed_at"]))
            failures.append(item)
            begin = f.get("full_at")
        if begin is not None and not run.problems:
            stretches.append((begin, max(r["t"] for r in steps if r["attempt"] == index) + 1))
    survived = [f for f in failures if not f["job_died"]]
    resumes = [f["resume_s"] for f in survived if "resume_s" in f]
    fulls = [f["full_size_s"] for f in survived if "full_size_s" in f]
    lost = [f["steps_lost"] for f in survived if "steps_lost" in f]
    after_replacement = [f["full_size_after_replacement_s"] for f in survived if "full_size_after_replacement_s" in f]
    between = throughput(steps, stretches)

    commits = [r["commit_s"] for r in records if "commit_s" in r and r["rank"] == 0]
    torchft = system.startswith("torchft")
    history = peer_torchft.history(records) if torchft else ledger.committed_history(records)
    useful = sum(len(r["indices"]) for r in history)
    processed = sum(r["n"] for r in steps)
    # Complete epochs only (torchft: its replica groups walk their shards each at its own pace).
    last_epoch = peer_torchft.complete_epochs(history) if torchft else max(r["epoch"] for r in history)
    checked = audit(records, last_epoch, history)
    kept = {(r["gen"], r["step"], r["rank"]) for r in history}
    begun_steps = [r for r in records if "gen" in r and "indices" in r]
    discarded = [r for r in begun_steps if (r["gen"], r["step"], r["rank"]) not in kept]
    kept_steps = {(r["gen"], r["step"]) for r in history}
    # A healing torchft group's batch ("part" false) is discarded, not its step.
    discarded_steps = {(r["gen"], r["step"]) for r in discarded if r.get("part", True)} - kept_steps
    recovered = []
    for run in attempts:
        for path in glob.glob(os.path.join(run.log_dir, "events-*.jsonl")):
            with open(path, encoding="utf-8") as handle:
                recovered.extend(e for e in map(json.loads, filter(str.strip, handle)) if e["event"] == "recovered")
    first_of_gen: Dict[Any, dict] = {}
    for event in sorted(recovered, key=lambda e: e["time"]):
        first_of_gen.setdefault(event.get("generation"), event)

    result.update({
        "failures": failures,
        "failures_survived": len(survived),
        "job_deaths": len(failures) - len(survived),
        "steps_lost_to_job_deaths": sum(f.get("steps_lost", 0) for f in failures if f["job_died"]),
        "resume_s": resumes, "resume_median_s": median(resumes), "resume_worst_s": max(resumes) if resumes else None,
        "full_size_s": fulls, "full_size_median_s": median(fulls), "full_size_worst_s": max(fulls) if fulls else None,
        "full_size_after_replacement_s": after_replacement,
        "full_size_after_replacement_median_s": median(after_replacement),
        "regrow_stall_median_s": median([f["regrow_stall_s"] for f in survived if "regrow_stall_s" in f]),
        "steps_lost": lost, "steps_lost_mean": statistics.mean(lost) if lost else None,
        "startup_s": attempts[0].first_full - attempts[0].launched if attempts[0].first_full else None,
        "training_wall_s": t_end - t0,
        "samples_processed": processed,
        "samples_useful": useful,
        "samples_recomputed": processed - useful,
        # Work thrown away: per-rank batches begun but not in the committed history (rolled back, or
        # discarded by torchft's should_commit, or a healing group's), and steps none of whose batches is.
        "batches_discarded": len(discarded),
        "steps_discarded": len(discarded_steps),
        "goodput_samples_per_s": useful / (t_end - t0),
        "throughput_between_failures_samples_per_s": between["samples_per_s"],
        "step_time_between_failures_s": between["step_time_s"],
        "throughput_windows": [{"from_s": w["from"] - t0, "to_s": w["to"] - t0, "samples_per_s": w["samples_per_s"]}
                               for w in between["windows"]],
        "commits_rank0": len(commits),
        "commit_median_s": median(commits),
        "commit_per_step_s": sum(commits) / len(rank0),
        "audited_epochs": last_epoch,
        "duplicated_samples": checked["duplicated"],
        "skipped_samples": checked["missing"],
        "exactly_once": checked["duplicated"] == 0 and checked["missing"] == 0 and last_epoch > 0,
        "audit_epochs": checked["epochs"],
        "library_recovery_events": [{k: e.get(k) for k in ("generation", "cause", "size", "recovery_s",
                                                             "steps_rolled_back")} for e in first_of_gen.values()],
        "timeline": timeline(steps, t0),
    })
    return result


def timeline(steps: List[dict], t0: float) -> List[List[Any]]:
    """Per second since the first step: [second, samples completed (all ranks), largest world size or None]."""
    end = int(steps[-1]["t"] - t0) + 1
    rows: List[List[Any]] = [[second, 0, None] for second in range(end + 1)]
    for r in steps:
        row = rows[int(r["t"] - t0)]
        row[1] += r["n"]
        row[2] = r["size"] if row[2] is None else max(row[2], r["size"])
    return rows


def failure_free(runs: List[Any]) -> Dict[str, Any]:
    """Throughput of failure-free jobs: from 1 s after the first step at 4 workers to the stop."""
    values, steps_s = [], []
    for run in runs:
        steps = sorted((r for r in ledger.read(run.log_dir) if "done" in r), key=lambda r: r["t"])
        if run.first_full is None or not steps:
            continue
        measured = throughput(steps, [(run.first_full, steps[-1]["t"] + 1)])
        if measured["samples_per_s"]:
            values.append(measured["samples_per_s"])
            steps_s.append(measured["step_time_s"])
    return {"samples_per_s": median(values), "runs_samples_per_s": values, "step_time_s": median(steps_s)}


def ratios(results: Dict[str, Dict[str, Any]], subject: str = "ext") -> Dict[str, Dict[str, Optional[float]]]:
    """``subject`` (an elastic_ext flavour) against each baseline, as a factor in its favour (> 1: better)."""
    ext = results.get(subject)
    if not ext:
        return {}
    return {name: harness.favour(ext, base, METRICS) for name, base in results.items() if not name.startswith("ext")}


# ------------------------------------------------------------------ plots


def plot_timeline(results: Dict[str, Dict[str, Any]], name: str) -> None:
    plt = harness.pyplot()
    shown = [r for r in results.values() if r.get("timeline")]
    span = max(r["timeline"][-1][0] for r in shown) + 2
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2.7 * len(shown)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        seconds = [row[0] for row in r["timeline"]]
        samples = [row[1] for row in r["timeline"]]
        size = [row[2] for row in r["timeline"]]
        ax.fill_between(seconds, samples, step="post", alpha=0.35, color="#2b6cb0", label="samples/s")
        ax.set_ylabel("samples per second")
        ax.set_xlim(0, span)
        twin = ax.twinx()
        xs = [i for i, s in enumerate(size) if s is not None]
        twin.plot([x + 0.5 for x in xs], [size[i] for i in xs], ".", color="#c05621", markersize=4)
        twin.set_ylim(0, 5)
        twin.set_ylabel("world size (dots)", color="#c05621")
        for k, f in enumerate(r["failures"]):
            ax.axvline(f["at_s"], color="red", linestyle="--", linewidth=1.2, label="SIGKILL" if k == 0 else None)
            if f.get("resumed_at_s") is not None:
                ax.axvline(f["resumed_at_s"], color="green", linestyle=":", linewidth=1.4,
                           label="first step after it" if k == 0 else None)
            if f.get("host_added_at_s") is not None:
                ax.axvline(f["host_added_at_s"], color="purple", linestyle="-.", linewidth=0.8,
                           label="spare host added" if k == 0 else None)
        title = (f"{r['label']}: goodput {r['goodput_samples_per_s']:.0f} samples/s, time to resume median "
                 f"{harness.fmt(r.get('resume_median_s'))} s, back to 4 workers median "
                 f"{harness.fmt(r.get('full_size_median_s'))} s")
        if r.get("job_deaths"):
            title += f" (the job died {r['job_deaths']}x and was relaunched)"
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds since the first step")
    harness.save_figure(fig, name)


METRIC_LABELS = {
    "resume_median": "time to resume\n(median)", "resume_worst": "time to resume\n(worst)",
    "full_size_median": "back to 4 workers\n(median)", "steps_lost_mean": "steps lost\nper failure",
    "goodput": "goodput", "throughput_no_failure": "throughput\nwithout failures",
    "commit_per_step": "commit cost\nper step",
}


def plot_ratios(table: Dict[str, Dict[str, Optional[float]]], name: str) -> None:
    plt = harness.pyplot()
    metrics = list(METRIC_LABELS)
    fig, ax = plt.subplots(figsize=(12, 4.2))
    width = 0.8 / max(1, len(table))
    for k, (system, values) in enumerate(table.items()):
        raw = [values.get(m) for m in metrics]
        heights = [min(v, 1e3) if v else 0 for v in raw]  # inf (elastic_ext lost nothing) drawn at 1000
        bars = ax.bar([i + k * width for i in range(len(metrics))], heights, width, label=f"vs {LABELS[system]}")
        for bar, value in zip(bars, raw):
            ax.annotate(harness.fmt(value) + ("x" if value is not None else ""),
                        (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), 0.011)),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1, color="k", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylim(0.01, 2e3)
    ax.set_xticks([i + width * (len(table) - 1) / 2 for i in range(len(metrics))])
    ax.set_xticklabels([METRIC_LABELS[m] for m in metrics], fontsize=8)
    ax.set_ylabel("factor in elastic_ext's favour\n(> 1: elastic_ext better)")
    ax.set_title("elastic_ext against each baseline (same model, data and failures)", fontsize=10)
    ax.legend(fontsize=8)
    harness.save_figure(fig, name)


TABLE_ROWS = [("time to resume, median (s)", "resume_median_s", 1), ("time to resume, worst (s)", "resume_worst_s", 1),
              ("back to 4 workers, median (s)", "full_size_median_s", 1),
              ("  same, from the replacement's start (s)", "full_size_after_replacement_median_s", 1),
              ("no step during the regrowth, median (s)", "regrow_stall_median_s", 1),
              ("steps lost per failure (mean)", "steps_lost_mean", 1),
              ("steps lost to job deaths", "steps_lost_to_job_deaths", 1),
              ("steps discarded (all failures)", "steps_discarded", 1),
              ("per-rank batches discarded", "batches_discarded", 1),
              ("goodput (samples/s)", "goodput_samples_per_s", 1),
              ("throughput w/o failures (samples/s)", "throughput_samples_per_s", 1),
              ("  same, between failures (samples/s)", "throughput_between_failures_samples_per_s", 1),
              ("commit, median (ms)", "commit_median_s", 1000), ("commit per step (ms)", "commit_per_step_s", 1000),
              ("duplicated samples", "duplicated_samples", 1), ("skipped samples", "skipped_samples", 1),
              ("audited epochs", "audited_epochs", 1)]


def print_table(results: Dict[str, Dict[str, Any]], table: Dict[str, Dict[str, Optional[float]]]) -> None:
    names = list(results)
    rows = [["failures survived / job deaths"]
            + [f"{results[n].get('failures_survived')} / {results[n].get('job_deaths')}" for n in names]]
    for label, key, scale in TABLE_ROWS:
        cells = [results[n].get(key) for n in names]
        rows.append([label] + [harness.fmt(c * scale if c is not None else None) for c in cells])
    print(harness.table([""] + [LABELS[n] for n in names], rows))
    for name, values in table.items():
        print(f"elastic_ext vs {LABELS[name]} (> 1: elastic_ext better): "
              + ", ".join(f"{k} {harness.fmt(v)}x" for k, v in values.items()))

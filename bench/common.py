"""Helpers shared by the benchmarks: memory probes, child processes, output files.

Memory is read from ``/proc/self/status`` (VmRSS, VmHWM). The peak (VmHWM)
can be reset by writing ``5`` to ``/proc/self/clear_refs``, so one process
can measure the peak of one operation at a time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024 * 1024


def proc_memory() -> Dict[str, int]:
    """Current and peak resident set size of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    return {"rss": values["VmRSS"], "peak": values["VmHWM"]}


def reset_peak() -> None:
    """Makes VmHWM start again from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def malloc_trim() -> bool:
    """Returns freed heap memory to the OS (glibc), so RSS counts only live allocations."""
    import ctypes
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def summary(samples: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def machine() -> Dict[str, Any]:
    """What the figures were measured on; the load average shows how busy it was."""
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    total = 0
    try:
        import psutil
        total = psutil.virtual_memory().total
    except ImportError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": total, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": list(os.getloadavg()),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_child(module: str, args: List[str], timeout_s: float) -> Dict[str, Any]:
    """Runs ``python -m module args`` in a fresh process; returns the JSON on its last stdout line.

    A fresh process per measurement keeps one system's allocations (and the
    allocator's reuse of freed pages) out of the other's memory figures.

    Raises:
        RuntimeError: the child failed or printed no JSON.
    """
    try:
        done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{module} {args} ran past {timeout_s} s") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{module} {args} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{module} {args} printed no JSON result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def write_json(name: str, data: Dict[str, Any]) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def bar_chart(name: str, title: str, panels: List[Dict[str, Any]]) -> str:
    """One PNG with a bar panel per entry: {"ylabel", "labels", "values", "target" (optional), "log"}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        colors = ["#2b6cb0" if label.startswith("elastic_ext") else "#c05621" for label in panel["labels"]]
        bars = ax.bar(range(len(panel["values"])), panel["values"], color=colors)
        ax.set_xticks(range(len(panel["labels"])))
        ax.set_xticklabels(panel["labels"], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(panel["ylabel"], fontsize=9)
        if panel.get("log"):
            ax.set_yscale("log")
        if panel.get("target") is not None:
            ax.axhline(panel["target"], color="k", linestyle="--", linewidth=1)
            ax.text(len(panel["values"]) - 0.5, panel["target"], panel.get("target_label", "target"),
                    ha="right", va="bottom", fontsize=7)
        for bar, value in zip(bars, panel["values"]):
            ax.annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b

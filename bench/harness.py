"""The benchmarks' harness: what every experiment in bench/ needs and none of them is about.

- jobs: :func:`horovodrun` (an elastic ``horovodrun`` over a host file of
  pseudo-hosts), :func:`local_host_names` (names of this machine Horovod
  treats as separate hosts), :func:`free_port`, and :class:`Watch` (a launched
  job and the JSON lines its workers write: wait for a record, idle, stop);
- faults: :func:`kill_delay` (the seeded jitter of a SIGKILL schedule) and
  :meth:`Watch.kill` (signals only a process of that job);
- timing and memory: :func:`timed`, :func:`summary`, :func:`proc_memory`,
  :func:`memory_of` (RSS kept and peak, optionally tracemalloc, of one call);
- child processes: :func:`run_child` (a fresh process per measurement, so one
  system's allocations never count in another's memory);
- results: :func:`machine`, :func:`write_json`, :func:`bar_chart`,
  :func:`table`, :func:`favour` (a ratio table in one system's favour).

Memory is read from ``/proc/self/status`` (VmRSS, VmHWM); writing ``5`` to
``/proc/self/clear_refs`` restarts the peak, so one process can measure the
peak of one operation at a time.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from devkit import launch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "bench", "results")
WORKERS = os.path.join(REPO_ROOT, "bench", "workers")
MIB = 1024 * 1024
POLL_S = 0.1
# Horovod's own default fusion buffer: these jobs measure time, not bit-for-bit equality
# (launch.base_env turns fusion off for the tests' bitwise comparisons).
HOROVOD_DEFAULT_FUSION = str(64 * 1024 * 1024)


# ---------------------------------------------------------------------- jobs

def horovodrun(script: str, script_args: Sequence[str], hosts_file: str, np_: int = 4, min_np: int = 2,
               max_np: int = 4, options: Sequence[str] = ()) -> List[str]:
    """``launch.elastic_cmd`` (elastic on loopback, hosts from ``hosts_file``) of the script at the
    absolute path ``script``, with ``options`` for horovodrun."""
    if not os.path.isabs(script):
        raise ValueError(f"script must be an absolute path, got {script!r}")
    # os.path.join(launch.WORKERS, script) is script itself when script is absolute.
    cmd = launch.elastic_cmd(np_, min_np, max_np, hosts_file, script, *script_args)
    return launch.with_options(cmd, options)


def local_host_names() -> List[str]:
    """Names that resolve to an address of this machine, so horovodrun runs them without ssh.

    ``localhost``, ``127.0.0.1``, ``launch.third_host()``, then the names
    /etc/hosts gives this machine's addresses and its other IPv4 addresses.
    Each is a separate host to Horovod (blacklisted on its own), which gives
    a job on one machine spare hosts to grow back onto after a failure.
    """
    import psutil

    addresses = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    candidates = ["localhost", "127.0.0.1"]
    try:
        candidates.append(launch.third_host())
    except RuntimeError:  # no third name: the spares below are none either
        pass
    try:
        with open("/etc/hosts", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split("#", 1)[0].split()
                if fields and fields[0] in addresses:
                    candidates.extend(fields[1:])
    except OSError:
        pass
    candidates.extend(sorted(a for a in addresses if not a.startswith("127.")))
    names: List[str] = []
    for name in candidates:
        try:
            if name not in names and socket.gethostbyname(name) in addresses:
                names.append(name)
        except OSError:
            continue
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_delay(number: int, uptime_s: float, jitter_s: float) -> float:
    """Seconds from a job at full size to its failure ``number``: ``uptime_s`` plus a jitter.

    A fixed delay locks onto the commit period and makes every failure lose
    the same number of steps; the jitter, seeded by ``number``, spreads the
    failures over the commit interval and is the same for every system.
    """
    return uptime_s + random.Random(number).uniform(0, jitter_s)


def writer_pid(path: str) -> int:
    """The pid of the worker that writes the steps file ``path`` (``steps-<pid>.jsonl``)."""
    return int(os.path.basename(path)[len("steps-"):-len(".jsonl")])


class Watch:
    """Launched jobs (one or several processes) and the ``steps-*.jsonl`` lines their workers append."""

    def __init__(self, jobs: List[launch.Job], log_dir: str, pattern: str = "steps-*.jsonl") -> None:
        self.jobs = jobs
        self.pattern = os.path.join(log_dir, pattern)
        self.offsets: Dict[str, int] = {}
        self.records: List[dict] = []

    def poll(self) -> List[dict]:
        """New whole lines since the last poll (a line being written waits for the next)."""
        new = []
        for path in glob.glob(self.pattern):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.records.extend(new)
        return new

    def alive(self) -> bool:
        return all(job.proc.poll() is None for job in self.jobs)

    def pids(self) -> set:
        """Every process these jobs started so far (remembered after they exit)."""
        pids: set = set()
        for job in self.jobs:
            job.track()
            pids |= job.descendants
        return pids

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float) -> Tuple[Optional[dict], str]:
        """(the earliest record, read or still to come, that satisfies ``predicate``, "") or
        (None, why not: the job exited or the timeout passed)."""
        seen = [r for r in self.records if predicate(r)]
        if seen:
            return min(seen, key=lambda r: r["t"]), ""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for record in self.poll():
                if predicate(record):
                    return record, ""
            if not self.alive():
                return None, "the job exited"
            self.pids()
            time.sleep(POLL_S)
        return None, f"timeout {timeout_s:.0f} s"

    def idle_until(self, when: float) -> None:
        while time.time() < when and self.alive():
            self.poll()
            self.pids()
            time.sleep(POLL_S)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> Optional[float]:
        """Sends ``sig`` to ``pid`` if it is a process of these jobs (never to another's).

        Returns the time it was sent, or None if ``pid`` is not theirs.
        """
        if pid not in self.pids():
            return None
        sent = time.time()
        os.kill(pid, sig)
        return sent

    def stop(self, timeout_s: float) -> List[Tuple[Optional[int], str]]:
        """Waits up to ``timeout_s`` per job, then kills what is left: (exit code or None, log name) per job."""
        ended = []
        for job in self.jobs:
            try:
                code, _ = job.wait(timeout_s)
            except AssertionError:  # launch.Job.wait's timeout: the tree is killed already
                code = None
            ended.append((code, os.path.basename(job.log_path)))
        return ended


# ------------------------------------------------------------ timing, memory

def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    """(seconds, value) of one call."""
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def summary(samples: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


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


def settled_rss() -> int:
    """RSS once garbage is collected and the allocator has given back what it only keeps for reuse."""
    gc.collect()
    malloc_trim()
    return proc_memory()["rss"]


def memory_of(fn: Callable[[], Any], trace: bool) -> Tuple[Dict[str, int], Any]:
    """({rss_kept, rss_peak[, tracemalloc_current, tracemalloc_peak]}, value) of one call, in bytes.

    tracemalloc sees numpy's allocations but slows code that makes many small
    Python objects several fold, so it is optional.
    """
    before = settled_rss()
    reset_peak()
    if trace:
        tracemalloc.start()
    value = fn()
    out: Dict[str, int] = {}
    if trace:
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.update(tracemalloc_current=current, tracemalloc_peak=peak)
    now = proc_memory()
    out.update(rss_kept=now["rss"] - before, rss_peak=now["peak"] - before)
    return out, value


def run_child(module: str, args: List[str], timeout_s: float) -> Dict[str, Any]:
    """Runs ``python -m module args`` in a fresh process; returns the JSON on its last stdout line.

    Raises:
        RuntimeError: the child failed, ran past ``timeout_s`` or printed no JSON.
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


# ------------------------------------------------------------------ results

def machine(**extra: Any) -> Dict[str, Any]:
    """What the figures were measured on; the load average shows how busy it was."""
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        import psutil
        total = psutil.virtual_memory().total
    except ImportError:
        total = 0
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": total, "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": list(os.getloadavg()),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}


def result_path(name: str) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    return os.path.join(RESULTS_DIR, name)


def write_json(name: str, data: Dict[str, Any], indent: int = 2) -> str:
    """bench/results/<name>.json, replaced at once (``launch.write_hosts`` writes any lines so)."""
    path = result_path(f"{name}.json")
    launch.write_hosts(path, [json.dumps(data, indent=indent)])
    return path


def save_figure(fig: Any, name: str, dpi: int = 100) -> str:
    """bench/results/<name>.png; closes the figure."""
    import matplotlib.pyplot as plt

    path = result_path(f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (benchmarks run headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def bar_chart(name: str, title: str, panels: List[Dict[str, Any]]) -> str:
    """One PNG with a bar panel per entry: {"ylabel", "labels", "values", "target" (optional), "log"}."""
    plt = pyplot()
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
    return save_figure(fig, name, dpi=110)


def fmt(value: Any) -> str:
    """A number as a table shows it: 3 significant digits, whole above 1000, n/a for None."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == float("inf"):
            return "inf"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table, columns padded to their widest cell (first column left-aligned)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def favour(mine: Dict[str, Any], theirs: Dict[str, Any], metrics: Dict[str, Tuple[str, bool]]
           ) -> Dict[str, Optional[float]]:
    """Per metric ``name: (field, lower_is_better)``, the factor in ``mine``'s favour (> 1: mine better).

    A field missing on either side gives None; ``mine`` at zero where lower
    is better gives infinity (or 1 when both are zero).
    """
    out: Dict[str, Optional[float]] = {}
    for name, (field, lower_is_better) in metrics.items():
        a, b = mine.get(field), theirs.get(field)
        if a is None or b is None:
            out[name] = None
        elif lower_is_better:
            out[name] = b / a if a else (float("inf") if b else 1.0)
        else:
            out[name] = a / b if b else None
    return out

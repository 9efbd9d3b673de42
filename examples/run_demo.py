"""The main job: elastic PyTorch training on localhost that survives a failure.

Runs examples/pytorch_elastic.py under ``elastic-horovodrun`` (the
project's launcher: real ``horovodrun`` with elastic_ext's driver), watched
from outside the script (``devkit/watched.py``), with two
pseudo-hosts (localhost and 127.0.0.1, two workers each), SIGKILLs one worker
mid-training, adds a third pseudo-host (this machine's hostname) once the job
has recovered (steps are slower until the job has all 6 workers, so that it
grows before training ends even when the newcomers take half a minute to
start), and ends with a summary: accuracy, samples processed (exactly once,
from the sample ledger), what happened at the failure and at the scale-up,
and a timeline picture (world size and steps over time).

    .venv/bin/python examples/run_demo.py [--kill-step 33] [--epochs 10]

Full logs, event files and the picture are kept in the directory printed at
the end. The exit status is 0 only if the job finished, learned, saw every
sample exactly once, and both the failure and the scale-up happened.

Words used in the summary:

- *steps rolled back*: completed training steps whose updates were undone
  by a rollback to the last commit (they are trained again). The step that
  was in flight when the failure hit never completed and is not counted.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from elastic_ext.events import read_events  # noqa: E402
from devkit import ledger  # noqa: E402
from devkit.launch import kill_tree, third_host  # noqa: E402

DATASET_SIZE = 1500  # digits minus the 297 test images held out by the example


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--kill-step", type=int, default=33, help="step at which rank 3 is SIGKILLed")
    parser.add_argument("--timeout-s", type=int, default=420)
    parser.add_argument("--out", default="", help="directory for logs and the picture (default: a new temp dir)")
    return parser.parse_args(argv)


class Job:
    """The horovodrun job, its host file and the scale-up thread."""

    def __init__(self, args, work):
        self.args = args
        self.work = work
        self.hosts = os.path.join(work, "hosts")
        self.events_path = os.path.join(work, "events.jsonl")
        self.ledger_dir = os.path.join(work, "ledger")
        try:
            self.new_host = third_host()  # this machine's hostname or a non-loopback address of it
        except RuntimeError as error:
            raise SystemExit(str(error))
        self.host_added_at = None  # Unix time the third host went into the host file
        self.accuracy = None
        with open(self.hosts, "w") as handle:
            handle.write("localhost:2\n127.0.0.1:2\n")

    def command(self):
        venv_bin = os.path.dirname(sys.executable)
        return [os.path.join(venv_bin, "elastic-horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "6",
                "--network-interfaces", "lo",
                "--host-discovery-script", f"{os.path.join(REPO, 'host_discovery', 'static.py')} {self.hosts}",
                # The example as users run it, watched from outside its code (devkit/watched.py): the fault,
                # the sample ledger, and slower steps until the job has its 6 workers, so that the scale-ups
                # come before the end of training even when the newcomers take half a minute to start (a cold
                # clean clone took over 20 s).
                sys.executable, "-m", "devkit.watched", "--ledger", self.ledger_dir,
                "--faults", f"3:{self.args.kill_step}:kill", "--step-sleep-s", "0.03", "--slow-below", "6:0.15",
                "--", os.path.join(HERE, "pytorch_elastic.py"), "--epochs", str(self.args.epochs)]

    def environment(self):
        venv_bin = os.path.dirname(sys.executable)
        return dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
                    PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    ELASTIC_EXT_EVENTS_PATH=self.events_path, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")

    def _grow_after_recovery(self, proc):
        """Adds the third pseudo-host to the host file a second after the first recovery."""
        while proc.poll() is None:
            if os.path.exists(self.events_path) and '"recovered"' in open(self.events_path).read():
                time.sleep(1)
                with open(self.hosts, "a") as handle:
                    handle.write(f"{self.new_host}:2\n")
                self.host_added_at = time.time()
                print(f"[demo] added host {self.new_host} (2 slots) to the host file", flush=True)
                return
            time.sleep(0.5)

    def run(self):
        """Runs the job to its end, echoing rank 0's output; returns the exit code."""
        rank0 = re.compile(r"^\[0\]<stdout>:(.*)$")
        started = time.time()
        log = open(os.path.join(self.work, "horovodrun.log"), "w")
        proc = subprocess.Popen(self.command(), env=self.environment(), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._grow_after_recovery, args=(proc,), daemon=True).start()
        try:
            for line in proc.stdout:
                log.write(line)
                match = rank0.match(line.rstrip("\n"))
                if match:
                    text = match.group(1)
                    print(text, flush=True)
                    found = re.search(r"done: test accuracy ([0-9.]+)", text)
                    if found:
                        self.accuracy = float(found.group(1))
                if time.time() - started > self.args.timeout_s:
                    raise TimeoutError(f"demo exceeded {self.args.timeout_s}s")
            return proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)  # horovodrun and every worker (Horovod gives them process groups of their own)
            log.close()


# ------------------------------------------------------------------ analysis

def incidents(events, faults, host_added_at):
    """One record per job transition (a failure or a resize), in time order.

    Every rank writes its own copy of an event; the earliest copy of each is
    kept. A transition starts with a ``rollback`` (a collective failed) or a
    ``resize`` (hosts changed) and ends with the ``recovered`` event of the
    next generation.
    """
    found = []
    current = None
    seen_generations = set()
    for event in events:
        if event["event"] in ("rollback", "resize") and current is None:
            current = {"trigger": event}
        elif event["event"] == "recovered" and event["generation"] not in seen_generations:
            seen_generations.add(event["generation"])
            if current is None:
                continue
            current["recovered"] = event
            found.append(current)
            current = None
    # The size the job started at, then after each transition; workers lost at the last failure.
    previous_size = next((e["size"] for e in events if "size" in e), None)
    since, lost, host_taken = 0.0, 0, False
    for incident in found:
        trigger, recovered = incident["trigger"], incident["recovered"]
        incident["kind"] = "failure" if trigger["event"] == "rollback" else "resize"
        incident["resumed_at"] = recovered["time"]
        incident["size"] = recovered["size"]
        incident["previous_size"] = previous_size
        if incident["kind"] == "failure":
            incident["steps_rolled_back"] = recovered.get("steps_rolled_back")
            killed = [f for f in faults if f["time"] <= trigger["time"]]
            incident["fault"] = killed[-1] if killed else None
        else:
            # An early start since the previous transition: newcomers (a failed slot's new worker,
            # an added host's workers) started while the survivors trained.
            early = [e for e in events if e["event"] == "prestart" and since <= e["time"] <= trigger["time"]]
            incident["early_start"] = early[0] if early else None
            incident["replaces_failed"] = lost > 0
            # Training that ends while newcomers are still starting takes them in at its last commit and
            # waits for them, so that every worker ends with the job (no "newcomers_joined" at that commit).
            commit = trigger.get("commit_id")
            incident["at_end"] = bool(early) and not any(
                e["event"] == "newcomers_joined" and e.get("commit_id") == commit for e in events) and any(
                e["event"] == "finish" and e.get("commit_id") == commit for e in events)
            # The added host's workers join at the first resize after the host was added that takes
            # in more workers than the failed ones' new workers (an early start under way takes
            # in workers that arrive while it lasts).
            grew_by = incident["size"] - (previous_size or incident["size"])
            if (early and host_added_at is not None and not host_taken and trigger["time"] >= host_added_at
                    and grew_by > lost):
                incident["host_added_at"], host_taken = host_added_at, True
        lost = previous_size - incident["size"] if incident["kind"] == "failure" and previous_size else 0
        previous_size, since = incident["size"], incident["resumed_at"]
    return found


def describe(incident, started):
    """Two or three plain sentences on one transition, for the summary."""
    t = incident["trigger"]["time"] - started
    size = incident["size"]
    if incident["kind"] == "failure":
        fault = incident["fault"]
        what = (f"rank {fault['rank']} was SIGKILLed at step {fault['step']}" if fault else "a worker failed")
        seen = incident["trigger"]["time"]
        gap = f" ({seen - fault['time']:.1f}s later)" if fault else ""
        return (f"t={t:5.1f}s  failure: {what}; the survivors' allreduce failed{gap}, "
                f"{incident['steps_rolled_back']} steps rolled back to the last commit (commit "
                f"{incident['trigger']['commit_id']}).\n"
                f"           back to training on {size} workers "
                f"{incident['resumed_at'] - seen:.1f}s after the failure was seen; the failed slot's new "
                f"worker starts meanwhile.")
    idle = incident["resumed_at"] - incident["trigger"]["time"]
    early = incident.get("early_start")
    grew = incident["previous_size"] is not None and size > incident["previous_size"]
    if early is None or not grew:
        return (f"t={t:5.1f}s  resize: hosts changed; no rollback; training resumed on {size} workers "
                f"{idle:.1f}s later.")
    why = []
    if incident.get("replaces_failed"):
        why.append("the failed slot's new worker")
    if incident.get("host_added_at") is not None:
        why.append(f"the host added at t={incident['host_added_at'] - started:.1f}s")
    joined = size - incident["previous_size"]
    kept = incident["trigger"]["time"] - early["time"]
    return (f"t={early['time'] - started:5.1f}s  scale-up to {size} workers ({joined} newcomer{'' if joined == 1 else 's'}"
            f"{': ' + ', '.join(why) if why else ''}): the survivors kept training for {kept:.1f}s while the "
            f"newcomers started and built their model\n"
            f"           (early start at commit {early['commit_id']}), then {ending(incident, idle)}; no rollback.")


def ending(incident, idle):
    """How a scale-up's early start ended: the newcomers ready at a commit, or training over before them."""
    commit = incident["trigger"]["commit_id"]
    if incident.get("at_end"):
        return (f"training ended (commit {commit}) before they were ready: survivors idle {idle:.1f}s until the "
                f"newcomers joined, so that every worker ends with the job")
    return f"resized at commit {commit}: survivors idle {idle:.1f}s while the newcomers received the state"


def soft_failures(events):
    """The first copy of each numeric rollback and straggler eviction (every rank writes one)."""
    seen, found = set(), []
    for event in events:
        key = (event["event"], event.get("commit_id"), event.get("step"))
        if event["event"] in ("numeric_rollback", "straggler") and key not in seen:
            seen.add(key)
            found.append(event)
    return found


def plot_timeline(path, records, found, started, host_added_at, soft=()):
    """World size and completed steps over time, every transition (and any numeric
    rollback or straggler eviction in ``soft``) marked; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted((r["t"] - started, r["step"], r["size"]) for r in records if "gen" in r and r["rank"] == 0)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), gridspec_kw={"height_ratios": [3, 1]})
    if steps:
        top.plot([s[0] for s in steps], [s[1] for s in steps], ".", markersize=3, color="tab:blue",
                 label="step started (rank 0)")
        bottom.step([s[0] for s in steps], [s[2] for s in steps], where="post", color="tab:green")
    marks = []
    for incident in found:
        trigger = incident["trigger"]["time"] - started
        resumed = incident["resumed_at"] - started
        if incident["kind"] == "failure":
            if incident.get("fault"):
                marks.append((incident["fault"]["time"] - started, "tab:red", "-", "worker SIGKILLed"))
            marks.append((trigger, "tab:orange", "--", "rollback"))
        else:
            if incident.get("host_added_at") is not None:
                marks.append((incident["host_added_at"] - started, "tab:purple", "-", "host added"))
            if incident.get("early_start") is not None:
                marks.append((incident["early_start"]["time"] - started, "tab:cyan", "-.",
                              "newcomers started early (survivors train on)"))
            marks.append((trigger, "tab:purple", "--", "resize (at a commit)"))
        marks.append((resumed, "black", ":", "training resumed"))
    for event in soft:
        label = "numeric rollback" if event["event"] == "numeric_rollback" else "straggler evicted"
        marks.append((event["time"] - started, "tab:brown" if event["event"] == "straggler" else "tab:olive", "-.",
                      label))
    if host_added_at is not None and not any(i.get("host_added_at") for i in found):
        marks.append((host_added_at - started, "tab:purple", "-", "host added"))
    labelled = set()
    for x, color, style, label in marks:
        for axis in (top, bottom):
            axis.axvline(x, color=color, linestyle=style, linewidth=1,
                         label=label if axis is top and label not in labelled else None)
        labelled.add(label)
    top.set_ylabel("training step")
    top.legend(loc="upper left", fontsize=8)
    top.set_title("elastic_ext demo: a failure and a scale-up")
    bottom.set_ylabel("workers")
    bottom.set_xlabel("seconds since the job started")
    sizes = [s[2] for s in steps] or [0]
    bottom.set_ylim(0, max(sizes) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summarize(job, code, started):
    """Prints the summary; returns True if the demo showed everything it should."""
    records = ledger.read(job.ledger_dir)
    epochs_seen = max((r["epoch"] for r in records if "epoch" in r), default=-1) + 1
    report = ledger.audit(records, dataset_size=DATASET_SIZE, epochs=epochs_seen)
    events = sorted(read_events(job.events_path), key=lambda e: e["time"])
    faults_dir = os.path.join(job.ledger_dir, "faults")  # the fault markers (devkit/watched.py)
    faults = []
    if os.path.isdir(faults_dir):
        for name in sorted(os.listdir(faults_dir)):
            with open(os.path.join(faults_dir, name)) as handle:
                faults.append(json.load(handle))
    found = incidents(events, faults, job.host_added_at)
    failures = [i for i in found if i["kind"] == "failure"]
    scale_ups = [i for i in found if i.get("host_added_at") is not None and i.get("early_start") is not None]

    print("\n=== summary ===")
    print(f"exit code {code}, wall time {time.time() - started:.0f}s, test accuracy {job.accuracy}")
    processed = sum(e["processed"] for e in report["epochs"])
    print(f"samples processed in the committed history: {processed} over {epochs_seen} epochs of "
          f"{DATASET_SIZE}; exactly once: {report['exactly_once']} "
          f"(duplicated {sum(e['duplicated'] for e in report['epochs'])}, "
          f"missing {sum(e['missing'] for e in report['epochs'])})")
    print("what happened:")
    for incident in found:
        print("  " + describe(incident, started))
    rolled_back = sum(i["steps_rolled_back"] or 0 for i in failures)
    print(f"steps rolled back in all: {rolled_back} (completed steps undone and trained again)")
    picture = plot_timeline(os.path.join(job.work, "timeline.png"), records, found, started, job.host_added_at,
                            soft_failures(events))
    print(f"timeline picture: {picture}")
    print(f"logs: {job.work}")
    problems = []
    if code != 0:
        problems.append(f"elastic-horovodrun exited with {code}")
    if job.accuracy is None:
        problems.append("rank 0 printed no final accuracy")
    if not report["exactly_once"]:
        problems.append("samples were not processed exactly once")
    if not failures:
        problems.append("no failure and recovery was seen")
    if not scale_ups:
        problems.append("no early-started scale-up that took in the added host was seen")
    print("verdict: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return not problems


def main(argv=None):
    args = parse_args(argv)
    work = args.out or tempfile.mkdtemp(prefix="elastic_ext_demo_")
    if os.path.exists(os.path.join(work, "ledger")):
        # Its fault markers would keep the failure from firing, its ledger mix two runs.
        raise SystemExit(f"--out ({work}) already holds a demo run; give a new directory")
    os.makedirs(work, exist_ok=True)
    job = Job(args, work)
    print(f"elastic_ext demo: 4 workers on 2 pseudo-hosts; rank 3 is killed at step {args.kill_step}; "
          f"a third host ({job.new_host}) joins after the recovery.\n", flush=True)
    started = time.time()
    code = job.run()
    return 0 if summarize(job, code, started) else 1


if __name__ == "__main__":
    sys.exit(main())

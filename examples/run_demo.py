"""The main job: elastic PyTorch training on localhost that survives a failure.

Runs examples/pytorch_elastic.py under real ``horovodrun`` with two
pseudo-hosts (localhost and 127.0.0.1, two workers each), SIGKILLs one worker
mid-training, adds a third pseudo-host (this machine's hostname) once the job has
recovered, and ends with a summary: accuracy, samples processed (exactly
once, from the sample ledger) and every recovery event with its duration.

    .venv/bin/python examples/run_demo.py [--kill-step 30] [--epochs 6]

Full logs and event files are kept in the directory printed at the end.
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

from elastic_ext import ledger  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--kill-step", type=int, default=33, help="step at which rank 3 is SIGKILLed")
parser.add_argument("--timeout-s", type=int, default=420)
args = parser.parse_args()

def third_host():
    """A third name for this machine that Horovod treats as local (no ssh):
    the hostname if it resolves to a local address, else a non-loopback IPv4."""
    import socket

    import psutil
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    try:
        if socket.gethostbyname(socket.gethostname()) in local:
            return socket.gethostname()
    except OSError:
        pass
    others = sorted(a for a in local if not a.startswith("127."))
    if not others:
        raise SystemExit("no third local host name found (hostname does not resolve to a local address)")
    return others[0]


NEW_HOST = third_host()
work = tempfile.mkdtemp(prefix="elastic_ext_demo_")
hosts = os.path.join(work, "hosts")
events_path = os.path.join(work, "events.jsonl")
ledger_dir = os.path.join(work, "ledger")
with open(hosts, "w") as handle:
    handle.write("localhost:2\n127.0.0.1:2\n")

venv_bin = os.path.dirname(sys.executable)
env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
           PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           ELASTIC_EXT_EVENTS_PATH=events_path, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
cmd = [os.path.join(venv_bin, "horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "6",
       "--network-interfaces", "lo",
       "--host-discovery-script", f"{os.path.join(REPO, 'host_discovery', 'static.py')} {hosts}",
       sys.executable, os.path.join(HERE, "pytorch_elastic.py"), "--epochs", str(args.epochs),
       "--ledger", ledger_dir, "--faults", f"3:{args.kill_step}:kill", "--step-sleep-s", "0.03"]

print(f"elastic_ext demo: 4 workers on 2 pseudo-hosts; rank 3 is killed at step {args.kill_step}; "
      "a third host joins after the recovery.\n", flush=True)
started = time.time()
log = open(os.path.join(work, "horovodrun.log"), "w")
proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)


def grow_after_recovery():
    """Adds a third pseudo-host to the host file once a recovery event has been written."""
    while proc.poll() is None:
        if os.path.exists(events_path) and '"recovered"' in open(events_path).read():
            time.sleep(3)
            with open(hosts, "a") as handle:
                handle.write(f"{NEW_HOST}:2\n")
            print(f"[demo] added host {NEW_HOST} (2 slots) to the host file", flush=True)
            return
        time.sleep(0.5)


threading.Thread(target=grow_after_recovery, daemon=True).start()
rank0 = re.compile(r"^\[0\]<stdout>:(.*)$")
accuracy = None
try:
    for line in proc.stdout:
        log.write(line)
        match = rank0.match(line.rstrip("\n"))
        if match:
            text = match.group(1)
            print(text, flush=True)
            found = re.search(r"done: test accuracy ([0-9.]+)", text)
            if found:
                accuracy = float(found.group(1))
        if time.time() - started > args.timeout_s:
            raise TimeoutError(f"demo exceeded {args.timeout_s}s")
    code = proc.wait(timeout=60)
finally:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    log.close()

records = ledger.read(ledger_dir)
epochs_seen = max((r["epoch"] for r in records if "epoch" in r), default=-1) + 1
report = ledger.audit(records, dataset_size=1500, epochs=epochs_seen)
events = [json.loads(line) for line in open(events_path)] if os.path.exists(events_path) else []
recoveries = {}
for event in events:
    if event["event"] == "recovered":
        recoveries.setdefault(event["generation"], event)

print("\n=== summary ===")
print(f"exit code {code}, wall time {time.time() - started:.0f}s")
print(f"test accuracy: {accuracy}")
processed = sum(e["processed"] for e in report["epochs"])
print(f"samples processed in the committed history: {processed} over {epochs_seen} epochs; "
      f"exactly once: {report['exactly_once']} "
      f"(duplicated {sum(e['duplicated'] for e in report['epochs'])}, "
      f"missing {sum(e['missing'] for e in report['epochs'])}); steps replayed after rollback: "
      f"{report['lost_steps']}")
print("recovery events (as seen by each worker's first report):")
for _, event in sorted(recoveries.items()):
    print(f"  {event['cause']:18s} world size -> {event['size']}, {event['steps_rolled_back']} steps rolled back, "
          f"back to training {event["recovery_s"]:.1f}s after the failure was seen")
print(f"logs: {work}")
sys.exit(0 if code == 0 and report["exactly_once"] and accuracy is not None else 1)

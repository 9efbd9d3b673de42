"""Under elastic-horovodrun, a local attacker without the job's secret forges requests to the driver's store
while the job trains; nothing changes (issue 53, findings C1 and H1 of the security audit).

The job: four PyTorch workers on two pseudo-hosts (``localhost:2``,
``127.0.0.1:2``). The forger is this test process. It finds the store as
any user of the machine can: the address and port are in every worker's
command line (Horovod prefixes the worker's command with
``HOROVOD_GLOO_RENDEZVOUS_ADDR=... HOROVOD_GLOO_RENDEZVOUS_PORT=...``; where
the shell execs the command the assignments are gone from it, and the
worker's environment has them). It sends, round after round while the job
trains, with no secret:

- a pickle whose loading creates a directory (a marker, one per scope),
  base64 as Horovod's codec writes it, PUT to every scope the store knows:
  ``worker_addresses`` (the one Horovod unpickled), Gloo's ``global``,
  ``local_0`` and ``cross_0``, ``rank_and_size`` and the launcher's three;
- a PUT of every key the launcher uses, with a value that would act: the
  round's ``current`` (garbage and a later round), ``failed_`` of the
  current round and the next, ``assigned``, ``capacity_left_out``, the
  dismissal of every slot, ``early_start``, ``early_start_asked``, every
  rank's ready key, and a notice for each host; a DELETE of the round keys.

Notices: a notice for host H from one of H's addresses is accepted by
design (``docs/launching.md``, "Trust boundary": a client at H's address is
H). Both pseudo-hosts are 127.0.0.1 (``localhost`` resolves to it), so
the forger sends the job hosts' notices from 127.0.0.2, a loopback address
that no listed host resolves to: the connection is served (loopback), the
notice is refused. A notice for a host the discovery never listed is sent
from 127.0.0.1.

Expected answers (``store_guard.py``): 400 for the pickle in
``worker_addresses`` (no global is resolved), 403 for every write of the
launcher's scopes; Gloo's scopes and ``rank_and_size`` store the bytes
(200; any client of the machine may write them, ``docs/launching.md``) and
nothing ever loads them. The job must end as the same job without the
forger ends: no marker, no rollback, member failure, leave or fence, four
workers from start to end, exit 0 and bitwise the same final weights as
its failure-free reference.
"""

import base64
import http.client
import os
import pickle
import re
import subprocess
import time

import psutil
import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch
from tests.multiprocess.references import references  # noqa: F401  (the session's shared runs)

DIGITS = 1797
EPOCHS = 2
COMMIT_EVERY = 4
WORKER_ARGS = ("--optimizer", "adam", "--step-sleep-s", "0.1")  # 0.1 s steps: the job trains for seconds
JOB_TIMEOUT_S = 300
FIND_TIMEOUT_S = 120       # the store's address and the first step, each
MAX_ROUNDS = 200           # the forger stops by itself after this many rounds
PACE_S = 0.5               # between rounds, the forger waits this long for the job's end
PEER = "127.0.0.2"         # a loopback address that none of the job's hosts resolves to
NEVER_LISTED = "forged-host"
JOB_HOSTS = ("localhost", "127.0.0.1")
ADDR_RE = re.compile(r"HOROVOD_GLOO_RENDEZVOUS_ADDR=(\S+)")
PORT_RE = re.compile(r"HOROVOD_GLOO_RENDEZVOUS_PORT=(\d+)")
# Events that a failure, a forged failure, a notice or a dismissal would cause; none may occur.
FORBIDDEN = ("rollback", "rollback_limit", "member_failed", "leave", "fenced", "links_closed", "reset",
             "recovered", "resize", "prestart", "newcomers_joined", "restarted_in_place", "job_restart")


class MakesMarker:
    """Pickles to a call of ``os.mkdir(path)``: whoever loads it creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def payload(markers, scope):
    return base64.b64encode(pickle.dumps(MakesMarker(str(markers / scope))))


def pickle_requests(markers):
    """(scope, method, path, body, source, expected answer): the pickle PUT to every scope."""
    scopes = [("worker_addresses", f"{JOB_HOSTS[0]}:0", "127.0.0.1", 400),  # the one Horovod unpickled
              ("global", "forged", "127.0.0.1", 200), ("local_0", "forged", "127.0.0.1", 200),
              ("cross_0", "forged", "127.0.0.1", 200), ("rank_and_size", "forged", "127.0.0.1", 200),
              ("elastic_ext_round", "current", "127.0.0.1", 403),
              ("elastic_ext_ready", "early_start", "127.0.0.1", 403),
              ("elastic_ext_notice", JOB_HOSTS[0], PEER, 403)]
    return [(f"pickle PUT /{scope}/{key}", "PUT", f"/{scope}/{key}", payload(markers, scope), source, expected)
            for scope, key, source, expected in scopes]


def key_requests(current):
    """(key, method, path, body, source, expected) for every key the launcher uses, forged for round ``current``."""
    forged = [("PUT", "/elastic_ext_round/current", b"not-a-round"),
              ("PUT", "/elastic_ext_round/current", str(current + 7).encode()),
              ("PUT", f"/elastic_ext_round/failed_{current}", b"localhost[0]"),
              ("PUT", f"/elastic_ext_round/failed_{current + 1}", b"127.0.0.1[1]"),
              ("PUT", "/elastic_ext_round/assigned", b"localhost:0"),
              ("PUT", "/elastic_ext_round/capacity_left_out", b"1"),
              ("DELETE", "/elastic_ext_round/current", b""),
              ("DELETE", "/elastic_ext_round/assigned", b"")]
    forged += [("PUT", f"/elastic_ext_round/dismissed_{host}:{lr}", b"1") for host in JOB_HOSTS for lr in (0, 1)]
    forged += [("PUT", f"/elastic_ext_ready/{key}", b"1") for key in ("early_start", "early_start_asked", "0", "1",
                                                                        "2", "3")]
    requests = [(f"{method} {path} {body.decode()}".rstrip(), method, path, body, "127.0.0.1", 403)
                for method, path, body in forged]
    requests += [(f"PUT /elastic_ext_notice/{host} from {PEER}", "PUT", f"/elastic_ext_notice/{host}", b"1", PEER, 403)
                 for host in JOB_HOSTS]
    requests.append((f"PUT /elastic_ext_notice/{NEVER_LISTED}", "PUT", f"/elastic_ext_notice/{NEVER_LISTED}", b"1",
                     "127.0.0.1", 403))
    return requests


def send(address, method, path, body, source):
    """(HTTP status, body) of one request from ``source``, or (the name of the error that ended it unanswered, b"")."""
    connection = http.client.HTTPConnection(address[0], address[1], timeout=10, source_address=(source, 0))
    try:
        connection.request(method, path, body=body if method == "PUT" else None)
        response = connection.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, b""
    finally:
        connection.close()


def store_address(job):
    """((address, port), where found) of the job's store: a worker's command line, or else its environment."""
    for pid in job.members():
        try:
            proc = psutil.Process(pid)
            line = " ".join(proc.cmdline())
            if PORT_RE.search(line) and ADDR_RE.search(line):
                return (ADDR_RE.search(line).group(1), int(PORT_RE.search(line).group(1))), "command line"
            environ = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # ended since it was listed
        if "HOROVOD_GLOO_RENDEZVOUS_PORT" in environ and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
            port = int(environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
            return (environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"], port), "environment"
    return None


def wait_for(job, what, predicate):
    """``predicate()``'s first true value, polled while the job runs; fails naming ``what`` after FIND_TIMEOUT_S."""
    deadline = time.monotonic() + FIND_TIMEOUT_S
    while True:
        job.track()
        value = predicate()
        if value:
            return value
        tail = lambda: open(job.log_path).read()[-4000:]  # noqa: E731
        assert job.proc.poll() is None, f"the job ended ({job.proc.returncode}) before its {what}:\n{tail()}"
        assert time.monotonic() < deadline, f"no {what} after {FIND_TIMEOUT_S}s:\n{tail()}\n{job.stacks()}"
        time.sleep(0.1)  # polling what the job writes


def start_job(out):
    out.mkdir()
    hosts_file = str(out / "hosts")
    launch.write_hosts(hosts_file, list(launch.HOSTS))
    cmd = launch.under_elastic_ext_driver(launch.elastic_cmd(
        4, 2, 4, hosts_file, "train_torch.py", "--out", str(out), "--epochs", str(EPOCHS),
        "--commit-every", str(COMMIT_EVERY), *WORKER_ARGS))
    return launch.Job(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl")),
                      str(out / "horovodrun.log"))


def forge_while_training(job, out, markers):
    """Forges round after round from the job's first step to its end (at most MAX_ROUNDS rounds).

    Returns (where the store's address was found, [(the round's end, {request: (status, expected)})]).
    """
    address, where = wait_for(job, "store address in a worker's command line or environment",
                              lambda: store_address(job))
    wait_for(job, "first training step", lambda: [r for r in ledger.read(str(out)) if "gen" in r])
    rounds = []
    for _ in range(MAX_ROUNDS):
        # The round's number, read as any client may (a GET): the forged failed_<n> name the live round.
        status, body = send(address, "GET", "/elastic_ext_round/current", None, "127.0.0.1")
        statuses = {"GET /elastic_ext_round/current": (status, 200)}
        round_id = int(body) if status == 200 and body.isdigit() else 0
        for name, method, path, value, source, expected in pickle_requests(markers) + key_requests(round_id):
            statuses[name] = (send(address, method, path, value, source)[0], expected)
        rounds.append((time.time(), statuses))
        try:
            job.proc.wait(PACE_S)  # the forger's pace; it stops as soon as the job ends
            break
        except subprocess.TimeoutExpired:
            job.track_now_and_then()
    return where, rounds


def run_reference(directory):
    out, _ = launch.run_job(directory, "train_torch.py", *WORKER_ARGS, epochs=EPOCHS, commit_every=COMMIT_EVERY,
                            timeout_s=JOB_TIMEOUT_S, launcher=True)
    events = analysis.read_events(str(out / "events.jsonl"))
    assert not [e for e in events if e["event"] in FORBIDDEN], "the reference run must run undisturbed"
    return analysis.load_finals(str(out))


@pytest.mark.timeout(900)
def test_forged_store_requests_without_the_secret_change_nothing(tmp_path, references):
    markers = tmp_path / "markers"
    markers.mkdir()
    out = tmp_path / "job"
    job = start_job(out)
    hung = None
    try:
        where, rounds = forge_while_training(job, out, markers)
        try:
            code, output = job.wait(JOB_TIMEOUT_S)
        except AssertionError as exc:  # timed out, killed: reported after what the forgeries did
            code, output, hung = None, open(job.log_path).read(), exc
    finally:
        job.kill()
    print(f"\nstore address found in the workers' {where}; {len(rounds)} forging rounds; statuses of the first: "
          f"{rounds[0][1] if rounds else None}")

    # Every way the forgeries showed, together (a store that accepts them shows several).
    problems = []
    loaded = sorted(p.name for p in markers.iterdir())
    if loaded:
        problems.append(f"a forged pickle was loaded (markers made for scopes {loaded})")
    records = ledger.read(str(out))
    last_step_at = max(r["t"] for r in records if "gen" in r)
    during = [statuses for at, statuses in rounds if at < last_step_at]
    if len(during) < 2:
        problems.append(f"only {len(during)} forging rounds ended before the job's last step: not while training")
    # While the workers train the store runs: every request gets its answer. Once they are done it may be
    # gone (the job ends while the forger is at work): a request may then end unanswered, never answered otherwise.
    wrong = {(name, got, want) for at, statuses in rounds for name, (got, want) in statuses.items()
             if got != want and (at < last_step_at or not (isinstance(got, str) or name.startswith("GET")))}
    if wrong:
        problems.append(f"answers other than expected (request, got, expected): {sorted(wrong, key=str)[:40]}")
    disturbed = [e for e in analysis.read_events(str(out / "events.jsonl")) if e["event"] in FORBIDDEN]
    if disturbed:
        problems.append(f"events of a disturbed job: {[(e['event'], e.get('rank')) for e in disturbed][:20]}")
    noticed = re.findall(r"host (\S+) has a preemption notice", output)
    if noticed or "dismissed this worker" in output:
        problems.append(f"hosts dropped on a forged notice: {noticed}; a worker dismissed: "
                        f"{'dismissed this worker' in output}")
    if hung is not None:
        problems.append(f"the job did not end: {str(hung)[:3000]}")
    elif code != 0:
        problems.append(f"the job failed ({code}):\n{output[-4000:]}")
    assert not problems, "the forgeries changed the job:\n- " + "\n- ".join(problems)
    assert "the driver's store answers 403" in output, "the guard logged no refusal: did the forger reach the store?"
    assert analysis.sizes_by_generation(records) == [[4]], "the job did not train on four workers from start to end"
    analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    finals = analysis.load_finals(str(out))
    assert sorted(finals) == [0, 1, 2, 3], f"final states of ranks {sorted(finals)}"
    analysis.assert_ranks_identical(finals)
    reference = references.get(("train_torch.py", "elastic-horovodrun", EPOCHS, COMMIT_EVERY, WORKER_ARGS),
                               run_reference)
    analysis.assert_bitwise_equal(finals[0], reference[0], "forged job vs its failure-free reference")

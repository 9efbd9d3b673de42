"""The corpus: training scripts written the way users write them (tests/multiprocess/corpus/,
docs/corpus.md), each compared with a one-process run of itself.

Each script runs three ways, in two launches:

1. ``--reference``: one process, no Horovod, the whole global batch per step,
   the same seed and steps: the math the user means. The PyTorch scripts'
   references that do not follow the job run one after the other in one
   process launched for the module (``corpus/_references.py``), so torch
   and Horovod are imported once for them, not once each. A script whose math
   depends on the world size (the learning rate scaled by ``hvd.size()``)
   follows the world sizes the elastic job went through, step by step
   (``--sizes``, read from the job's sample ledger).
2. Under ``elastic-horovodrun`` on 4 workers (two pseudo-hosts of 2 slots),
   failure-free up to the commit of step ``DUMP_STEP``, where every rank
   dumps its weights: the failure-free phase.
3. The same job goes on through a SIGKILL of rank 3 at step ``KILL_STEP``
   (a rollback to the commit before it; under the launcher the dead
   worker's slot is offered again, so a newcomer joins: a grow, with a full
   sync), and a SIGTERM to rank 1 at step ``Script.term_step`` (a graceful
   leave at a following commit: a shrink). At that step rank 0 takes the
   leaver's slot out of the host file (``--leave-frees``), as a preempted
   host goes away, so that no second newcomer takes it. While the world has
   fewer than 4 workers the steps are paced (``--slow-below``) so that the
   newcomer can join while the job trains. On this loaded 2-core machine a
   newcomer takes 4 to 8 s to start, so it usually joins before the leave,
   or in its reset (one reset: one worker out, one in); either way it is
   synced, and the final states of every rank, newcomers included, are
   compared.

Asserted per script, each assertion naming its phase:

- failure-free: every rank's dump bitwise identical, within the tolerance of
  the reference's weights at the same step, and no ``replica_mismatch``
  event before the first rollback (the replica check runs at every commit,
  ``ELASTIC_EXT_REPLICA_CHECK_EVERY=1``: at its default of 10 it would never
  run in a job of 6 or 7 commits);
- faulted: the job went through a rollback, a sync with newcomers and a
  leave; it exits 0; every rank's final state bitwise identical; final
  weights within the tolerance of the reference's; no ``replica_mismatch``;
  every sample exactly once per epoch in the committed history where the
  script draws from ``ElasticSampler``.

The tolerance (summation order). A data-parallel step computes the same
gradient as the one-process step, as a sum over the same per-sample terms in
another order: per-rank partial sums (kernels block them by batch size),
then Horovod's ring allreduce, and a mean of per-rank means for the mean of
the whole batch. Summing n terms in float32 (unit roundoff u = 2^-24) in
any order is exact to within (n - 1) u sum|terms| at worst, and, rounding
errors being independent and of mean zero, to within lambda sqrt(n) u
sum|terms| with probability at least 1 - 2 exp(-lambda^2 / 2) (Higham and
Mary's probabilistic bound, SIAM J. Sci. Comput. 2019), which is what
summation order gives in practice. So each step's gradient agrees to about
lambda sqrt(n) u relative, n the terms of one gradient entry: the global
batch of 60 plus the ranks, at most 64. Through T steps the weights'
difference grows at most by the sum of such relative differences times the
update's size, which stays below the weights' own scale max(1, max|w|) in
these short runs, so the bound is ``K * u * sqrt(n) * T * max(1,
max|w_ref|)`` with K = lambda = 10 (a failure probability below 1e-21 per
sum, and room for the amplification by nonlinear layers and Adam's division
by a moment). With T = 24 and n = 64 that is 1.1e-4 of the weights' scale
(the causal LM, 388 terms: 2.8e-4; 48 steps: 2.3e-4). The worst-case form
(n instead of sqrt(n)) would allow 9.2e-4 and 5.6e-3, loose enough to let
the language model's lost schedule (1.7e-2 at step 8, weights of scale 4)
pass.

Under bf16 autocast the weight gradient of each layer is a matmul whose
output is rounded to bfloat16 (u = 2^-8) once per rank's partial sum, so the
step's gradient agrees to about u relative whatever n; AdamW's update is
the gradient's moments' ratio times the learning rate, so a relative error
u in the gradient moves an entry by at most about u lr_t, and over the steps
by u sum_t lr_t. The bound there is ``K * 2^-8 * sum_t lr_t * max(1,
max|w_ref|)``: 2.8e-3 for 24 steps at lr 3e-3 at most.

A restore that loses a scheduler's link, or a wrong learning rate on one
rank, moves weights by 1e-2 or more; the measured deviations of the scripts
that pass (printed by each test as ``corpus-report``, and in docs/corpus.md)
are 2e-8 to 1.1e-6 in float32 (100 times below the bound at least), 3e-4
under bf16 (10 times below).
"""

import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

CORPUS = os.path.join(launch.REPO, "tests", "multiprocess", "corpus")
HOSTS = ("localhost:2", "127.0.0.1:2")
DUMP_STEP, KILL_STEP = 8, 9
K = 10
FLOAT32_U, BFLOAT16_U = 2.0 ** -24, 2.0 ** -8


@dataclasses.dataclass(frozen=True)
class Script:
    name: str
    steps: int = 24               # steps of the whole run
    samples: int = 720            # dataset size; None: the script draws no ElasticSampler samples
    epochs: int = 2
    summands: int = 64            # terms of one gradient entry's sum (global batch + ranks)
    unit_roundoff: float = FLOAT32_U
    size_dependent: bool = False  # its math follows hvd.size(): the reference takes the job's sizes
    args: tuple = ()
    term_step: int = 18           # the SIGTERM's step (the leave follows at a later commit)
    timeout_s: int = 240

    adam_lr_sum: float = 0.0      # bf16: the sum over the steps of Adam's learning rate (see the module docstring)
    tensorflow: bool = False      # its reference gets a process of its own (Keras names variables by a
                                  # process-wide counter), not the PyTorch references' shared one

    @property
    def tolerance_factor(self):
        if self.adam_lr_sum:
            return K * self.unit_roundoff * self.adam_lr_sum
        return K * self.unit_roundoff * math.sqrt(self.summands) * self.steps


SCRIPTS = [
    Script("lambda_warmup_cosine"),
    Script("onecycle_after_wrapper"),
    Script("plateau", samples=360, epochs=4),
    # 15 samples per rank: 12 steps an epoch at 4 workers, 16 at 3, 24 at 2. The leave comes late,
    # so that the newcomer joins before it: 4 workers, 3, 4 again (a grow), then 3 (a shrink).
    Script("lr_times_size", steps=48, size_dependent=True, term_step=20),
    Script("clip_grad_norm"),
    Script("accumulate_passes"),
    Script("accumulate_by_hand"),
    Script("autocast_bf16", unit_roundoff=BFLOAT16_U, adam_lr_sum=24 * 3e-3),
    Script("param_groups_frozen"),
    Script("gan_two_optimizers"),
    Script("ema_averaged_model"),
    Script("dataloader_workers"),
    Script("compiled_model"),
    # 24 sequences of 16 tokens a step: a gradient entry sums 384 terms.
    Script("causal_lm", samples=288, summands=24 * 16 + 4),
    Script("tf_function_schedule", timeout_s=300, tensorflow=True),
    # 12 steps an epoch, a commit every 4 batches of an epoch; 4 epochs.
    Script("keras_fit_callbacks", steps=48, epochs=4, timeout_s=300, tensorflow=True),
]


def script_cmd(script, out, *extra):
    return [sys.executable, os.path.join(CORPUS, f"{script.name}.py"), "--out", str(out), *script.args, *extra]


def run_reference(tmp_path, script, sizes=None):
    out = tmp_path / "reference"
    extra = ["--dump-at", str(DUMP_STEP)]
    if sizes is not None:
        path = tmp_path / "sizes.json"
        path.write_text(json.dumps(sizes))
        extra += ["--sizes", str(path)]
    code, output = launch.run(script_cmd(script, out, "--reference", *extra), launch.base_env(),
                              str(tmp_path / "reference.log"), 180)
    assert code == 0, f"phase 'reference': exit {code}\n{output[-5000:]}"
    return out


def batched(script):
    """True for a reference that runs with the others in one process: PyTorch, not following the job's sizes."""
    return not (script.size_dependent or script.tensorflow)


@pytest.fixture(scope="module")
def torch_references(request, tmp_path_factory):
    """The batched references of the scripts this session runs, all in one process
    (corpus/_references.py: torch and Horovod imported once, not once each): {script name: (out
    directory, status file)}, the launch's exit status and its log."""
    selected = {item.callspec.params["script"].name for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    root = tmp_path_factory.mktemp("references")
    plan, runs = [], {}
    for script in (s for s in SCRIPTS if batched(s) and s.name in selected):
        out = root / script.name
        runs[script.name] = (out, out / "status.json")
        plan.append([os.path.join(CORPUS, f"{script.name}.py"),
                     ["--out", str(out), *script.args, "--reference", "--dump-at", str(DUMP_STEP)],
                     str(out / "status.json")])
    if not plan:
        return runs, 0, ""
    (root / "plan.json").write_text(json.dumps(plan))
    code, output = launch.run([sys.executable, os.path.join(CORPUS, "_references.py"), str(root / "plan.json")],
                              launch.base_env(), str(root / "references.log"), 600)
    return runs, code, output


def batched_reference(torch_references, script):
    runs, code, output = torch_references
    out, status_file = runs[script.name]
    status = json.loads(status_file.read_text()) if status_file.exists() else None
    assert status is not None and status["ok"], \
        f"phase 'reference': {status['error'] if status else f'no outcome (exit {code})'}\n{output[-3000:]}"
    return out


def run_faulted(tmp_path, script):
    out = tmp_path / "job"
    out.mkdir()
    hosts = str(out / "hosts")
    launch.write_hosts(hosts, list(HOSTS))
    cmd = [os.path.join(launch.VENV_BIN, "elastic-horovodrun"), "-np", "4", "--min-np", "2", "--max-np", "4",
           "--network-interfaces", "lo", "--host-discovery-script", f"{launch.STATIC} {hosts}",
           *script_cmd(script, out, "--dump-at", str(DUMP_STEP),
                       "--faults", f"3:{KILL_STEP}:kill,1:{script.term_step}:term", "--leave-frees", hosts,
                       "--slow-below", "4:0.6")]
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), ELASTIC_EXT_REPLICA_CHECK_EVERY=1,
                          HOROVOD_GLOO_TIMEOUT_SECONDS=120)
    code, output = launch.run(cmd, env, str(out / "horovodrun.log"), script.timeout_s)
    return out, code, output


def sizes_of(out):
    """{step: world size} of the job's committed history (the steps whose effect is in its final weights)."""
    sizes = {}
    for record in ledger.committed_history(ledger.read(str(out))):
        sizes.setdefault(record["step"], set()).add(record["size"])
    assert all(len(s) == 1 for s in sizes.values()), f"ranks disagree on a step's world size: {sizes}"
    return {step: s.pop() for step, s in sorted(sizes.items())}


def deviation(got, want, what):
    """Max |got - want| over the model's weights (``model/``), and the scale max(1, max|want|)."""
    keys = sorted(k for k in want if "model/" in k)
    assert keys and sorted(k for k in got if "model/" in k) == keys, f"{what}: keys differ"
    diff = max(float(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)).max()) for k in keys)
    scale = max(1.0, max(float(np.abs(want[k]).max()) for k in keys))
    return diff, scale


def load_dumps(out):
    dumps = {}
    for name in sorted(os.listdir(out)):
        if name.startswith("dump-") and name.endswith(".npz"):
            with np.load(out / name) as data:
                dumps[int(name[5:-4])] = {k: data[k].copy() for k in data.files}
    return dumps


@pytest.mark.timeout(420)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_script_matches_its_one_process_run_failure_free_and_through_kill_grow_and_leave(tmp_path, script,
                                                                                       torch_references):
    # The reference first, where it does not depend on the job (a compiled model's kernels are then cached).
    reference = batched_reference(torch_references, script) if batched(script) else \
        None if script.size_dependent else run_reference(tmp_path, script)
    out, code, output = run_faulted(tmp_path, script)
    events = analysis.read_events(str(out / "events.jsonl")) if (out / "events.jsonl").exists() else []
    first_fault = min((e["time"] for e in events if e["event"] == "rollback"), default=float("inf"))
    mismatches = [e for e in events if e["event"] == "replica_mismatch"]
    report = {"script": script.name, "exit": code}
    failures = []

    # Phase 1, failure-free: the dumps of the commit of DUMP_STEP.
    sizes = sizes_of(out) if (out / "hosts").exists() else None
    if reference is None:
        reference = run_reference(tmp_path, script, sizes)
    dumps = load_dumps(out)
    reference_dump = load_dumps(reference)[0]
    if sorted(dumps) != [0, 1, 2, 3]:
        failures.append(f"phase 'failure-free': dumps of ranks {sorted(dumps)}, expected [0, 1, 2, 3]")
    else:
        try:
            analysis.assert_ranks_identical(dumps)
        except AssertionError as exc:
            failures.append(f"phase 'failure-free': ranks differ at step {DUMP_STEP}: {exc}")
        for rank, dump in dumps.items():
            diff, scale = deviation(dump, reference_dump, f"dump of rank {rank}")
            report[f"failure_free_rank{rank}"] = diff
            if diff > script.tolerance_factor * scale:
                failures.append(f"phase 'failure-free': rank {rank} is {diff:.3g} from the reference at step "
                                f"{DUMP_STEP} (bound {script.tolerance_factor * scale:.3g})")
    early = [e for e in mismatches if e["time"] < first_fault]
    if early:
        failures.append(f"phase 'failure-free': replica_mismatch before any fault: {early[:2]}")

    # Phase 2, faulted: a kill, a grow, a leave; the end.
    if code != 0:
        failures.append(f"phase 'faulted': the job exited {code}: {output[-3000:]}")
    else:
        kinds = {e["event"] for e in events}
        grew = [e for e in events if e["event"] == "sync" and e.get("newcomers")]
        if "rollback" not in kinds or not grew or "leave" not in kinds:
            failures.append(f"phase 'faulted': expected a rollback, a sync with newcomers and a leave; events "
                            f"{sorted(kinds)}, syncs with newcomers {grew}")
        records = ledger.read(str(out))
        begun = ledger.starts(records)
        report["generation_starts"] = [begun[g][2] for g in sorted(begun)]  # the step each began at
        report["world_sizes"] = analysis.sizes_by_generation(records)  # of the generations that trained
        finals = analysis.load_finals(out)
        try:
            analysis.assert_ranks_identical(finals)
        except AssertionError as exc:
            failures.append(f"phase 'faulted': final states differ between ranks: {exc}")
        reference_final = analysis.load_finals(reference)[0]
        for rank, final in finals.items():
            diff, scale = deviation(final, reference_final, f"final of rank {rank}")
            report[f"final_rank{rank}"] = diff
            if diff > script.tolerance_factor * scale:
                failures.append(f"phase 'faulted': rank {rank} ends {diff:.3g} from the reference "
                                f"(bound {script.tolerance_factor * scale:.3g})")
        late = [e for e in mismatches if e["time"] >= first_fault]
        if late:
            failures.append(f"phase 'faulted': replica_mismatch after the first fault: {late[:2]}")
        if script.samples:
            audit = ledger.audit(ledger.read(str(out)), script.samples, script.epochs)
            if not audit["exactly_once"]:
                failures.append(f"phase 'faulted': not exactly once: {audit['epochs']}")
    report["bound"] = script.tolerance_factor
    print("corpus-report", json.dumps(report))
    assert not failures, "\n".join(failures)

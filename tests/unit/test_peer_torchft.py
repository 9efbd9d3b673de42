"""bench/peer_torchft.py's reading of torchft's step log: which batches went into a committed step.

torchft commits or discards each step per replica group, so the benchmark
cannot use the ledger's generation model; these cases are the ones its
runs produce (a discarded step, a healing group, a worker killed before
its outcome) and decide the duplicated/skipped figures it reports.
"""

from bench import peer_torchft
from devkit import ledger


def step(rank, quorum, number, indices, part=True, epoch=0):
    return {"gen": quorum, "part": part, "epoch": epoch, "cursor": 0, "step": number, "rank": rank,
            "size": 2, "indices": indices, "pads": 0, "t": 0.0}


def outcome(rank, quorum, number, committed, part=True):
    return {"outcome": number, "g": quorum, "committed": committed, "part": part, "rank": rank, "t": 0.0}


def test_committed_discarded_healing_and_killed_steps():
    group0 = [step(0, 1, 0, [0, 1]), outcome(0, 1, 0, True),
              step(0, 1, 1, [2, 3]), outcome(0, 1, 1, False),        # should_commit said no: lost
              step(0, 2, 1, [4, 5]), outcome(0, 2, 1, True)]
    group1_dead = [step(1, 1, 0, [6, 7]),                           # killed before its outcome; group 0
                   step(1, 1, 1, [8, 9])]                           # committed step 0, discarded step 1
    group1_new = [step(1, 2, 1, [10, 11], part=False), outcome(1, 2, 1, True, part=False)]  # healing: zeros
    kept = peer_torchft.history(group0 + group1_dead + group1_new)
    assert sorted(i for r in kept for i in r["indices"]) == [0, 1, 4, 5, 6, 7]
    assert peer_torchft.discarded_steps(group0 + group1_dead + group1_new) == (1, 2)


def test_the_ledger_audits_a_given_history():
    records = [step(0, 1, 0, [0, 1]), outcome(0, 1, 0, True), step(1, 1, 0, [2, 1]), outcome(1, 1, 0, True),
               step(0, 1, 1, [0, 0], epoch=1), outcome(0, 1, 1, True), step(1, 1, 1, [3, 2], epoch=1),
               outcome(1, 1, 1, True)]
    kept = peer_torchft.history(records)
    assert peer_torchft.complete_epochs(kept) == 0  # four groups expected, two seen
    report = ledger.audit(records, 4, 1, kept)
    assert (report["epochs"][0]["duplicated"], report["epochs"][0]["missing"]) == (1, 1)  # 1 twice, 3 never

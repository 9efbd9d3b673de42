"""devkit.ledger: the committed history when a generation is begun twice.

Every worker holding the commit dies; the next round (workers restarted in
place, new workers in the dead ones' slots) resumes from the checkpoint and
numbers its generation as the dead workers had already numbered theirs.
Found by bench.soak: 256 samples read as duplicated in a run whose
training had duplicated nothing.
"""

import json

from devkit import ledger

SIZE = 8  # one sample per cursor, two ranks: rank r processes sample 2 * cursor + r


def write(tmp_path, pid, records):
    with open(tmp_path / f"steps-{pid}.jsonl", "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def start(gen, cursor, rank, t):
    return {"start": gen, "epoch": 0, "cursor": cursor, "step": cursor, "rank": rank, "size": 2, "t": t}


def step(gen, cursor, rank, t):
    return {"gen": gen, "epoch": 0, "cursor": cursor, "step": cursor, "rank": rank, "size": 2,
            "indices": [2 * cursor + rank], "pads": 0, "t": t}


def dead_cohort_then_resumed_one(tmp_path, resumed_at):
    # Generation 1 trains cursors 0 and 1 and commits at 2 (durable); generation 2
    # begins at 2, trains 2, and both its workers die. The round after resumes
    # from the checkpoint at 2 as generation 2, resumed_at seconds later.
    for rank in (0, 1):
        write(tmp_path, 100 + rank, [start(1, 0, rank, 0.0), step(1, 0, rank, 0.1), step(1, 1, rank, 0.2),
                                     start(2, 2, rank, 0.3), step(2, 2, rank, 0.4)])
        write(tmp_path, 200 + rank, [start(2, 2, rank, resumed_at)]
              + [step(2, c, rank, resumed_at + 0.1 * c) for c in (2, 3)])


def test_a_generation_begun_again_after_every_worker_died_reads_as_a_later_cohort(tmp_path):
    dead_cohort_then_resumed_one(tmp_path, resumed_at=20.0)
    records = ledger.read(str(tmp_path))
    assert sorted(ledger.starts(records)) == [1, 2, 2 + 1 / ledger.COHORTS]
    report = ledger.audit(records, dataset_size=SIZE, epochs=1)
    assert report["exactly_once"], report
    assert report["lost_steps"] == 1  # the dead cohort's step at cursor 2


def test_without_the_split_the_dead_cohorts_step_reads_as_duplicated(tmp_path):
    # What the audit said before: the same files, read as one generation 2.
    dead_cohort_then_resumed_one(tmp_path, resumed_at=20.0)
    records = [r for pid in (100, 101, 200, 201)
               for r in map(json.loads, open(tmp_path / f"steps-{pid}.jsonl"))]
    report = ledger.audit(records, dataset_size=SIZE, epochs=1)
    assert report["epochs"][0]["duplicated"] == 2, report


def test_workers_of_one_generation_stay_one_cohort(tmp_path):
    # A worker killed right after writing its start (a span of one instant), and
    # one that wrote its start half a second after the others: one generation.
    write(tmp_path, 1, [start(1, 0, 0, 0.0), step(1, 0, 0, 0.1)])
    write(tmp_path, 2, [start(1, 0, 1, 0.0)])
    write(tmp_path, 3, [start(1, 0, 1, 0.5), step(1, 0, 1, 0.6), step(1, 1, 1, 0.7)])
    write(tmp_path, 4, [step(1, 1, 0, 0.7)])
    records = ledger.read(str(tmp_path))
    assert sorted(ledger.starts(records)) == [1]
    assert {r["gen"] for r in records if "gen" in r} == {1}

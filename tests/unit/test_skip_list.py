"""The elastic partitioner's skip list (a numeric rollback's bad step) and the ledger's skipped records."""

import numpy as np
import pytest

from elastic_ext.errors import PartitionError
from elastic_ext.data.sampler import ElasticPartitioner
from devkit import ledger


def partitioner(size=100, rank=0, world=1, **kwargs):
    kwargs.setdefault("global_batch_size", 10)
    return ElasticPartitioner(size, shuffle=False, world=lambda: (rank, world), **kwargs)


def consume(sampler):
    """Runs the epoch as a training loop does: batches, record_step after each. Returns (cursor, indices) per step."""
    steps = []
    for indices, pad in sampler.batches():
        steps.append((sampler.cursor, indices[~pad].tolist()))
        sampler.record_step()
    return steps


def test_a_skipped_step_is_never_handed_out_and_every_other_step_is():
    sampler = partitioner()
    assert sampler.skip(0, 30, 40) is True
    assert len(sampler) == 9
    steps = consume(sampler)
    assert [cursor for cursor, _ in steps] == [0, 10, 20, 40, 50, 60, 70, 80, 90]
    taken = [i for _, ids in steps for i in ids]
    assert sorted(taken) == [i for i in range(100) if not 30 <= i < 40]
    assert sampler.cursor == 100 and sampler.epoch_done


def test_a_skip_at_the_cursor_moves_it_first_and_adjacent_skips_chain():
    sampler = partitioner()
    sampler.cursor = 30
    sampler.skip(0, 30, 40)
    sampler.skip(0, 40, 50)
    assert sampler.step_range() == (0, 50, 60)
    assert consume(sampler)[0][0] == 50


def test_every_rank_together_covers_all_but_the_skipped_samples_once():
    shares = []
    for rank in range(3):
        sampler = partitioner(size=95, rank=rank, world=3, global_batch_size=12, policy="pad")
        sampler.skip(0, 24, 36)   # a middle step
        sampler.skip(0, 84, 95)   # the last, padded step (11 positions)
        shares.extend(i for _, ids in consume(sampler) for i in ids)
    assert sorted(shares) == [i for i in range(84) if not 24 <= i < 36]


def test_skips_are_committed_state_and_older_commits_load_without_them():
    sampler = partitioner()
    sampler.skip(0, 20, 30)
    state = sampler.state_dict()
    assert state["skipped"] == [[0, 20, 30]]
    other = partitioner()
    other.load_state_dict(state)
    assert other.skipped == [[0, 20, 30]]
    del state["skipped"]
    other.load_state_dict(state)
    assert other.skipped == []


def test_adding_a_skip_twice_is_a_no_op_and_past_epochs_are_forgotten():
    sampler = partitioner()
    assert sampler.skip(0, 20, 30) is True and sampler.skip(0, 20, 30) is False
    sampler.skip(1, 0, 10)
    assert sampler.skipped == [[0, 20, 30], [1, 0, 10]]
    sampler.set_epoch(1)
    assert sampler.skipped == [[1, 0, 10]]
    assert consume(sampler)[0][0] == 10


@pytest.mark.parametrize("epoch, start, stop", [(0, 30, 30), (0, 40, 30), (0, -1, 5), (0, 90, 101), (-1, 0, 10)])
def test_a_bad_range_is_a_clear_error(epoch, start, stop):
    with pytest.raises(PartitionError, match=rf"epoch {epoch} \[{start}, {stop}\)"):
        partitioner().skip(epoch, start, stop)


def test_the_ledger_audit_counts_skipped_samples_once_and_catches_a_skipped_sample_also_processed(tmp_path):
    book = ledger.Ledger(str(tmp_path))
    book.start(1, 0, 0, 0, 0, 1)
    for cursor in (0, 10, 30):
        book.step(1, 0, cursor, cursor // 10, 0, 1, list(range(cursor, cursor + 10)))
    for rank in (0, 1):  # every rank writes it; one range all the same
        book.skipped(0, 20, 30, list(range(20, 30)), "nonfinite_loss", 2, rank)
    book._file.flush()
    report = ledger.audit(ledger.read(str(tmp_path)), 40, 1)
    assert report["exactly_once"], report
    assert report["epochs"][0]["skipped"] == 10 and report["epochs"][0]["processed"] == 30

    book.step(1, 0, 40, 4, 0, 1, [25])  # the bad step's sample processed after all
    book._file.flush()
    report = ledger.audit(ledger.read(str(tmp_path)), 41, 1)
    assert not report["exactly_once"] and report["epochs"][0]["duplicated_ids"] == [25]
    assert np.array_equal(report["epochs"][0]["missing_ids"], [40])

"""bench.restore_cow: both restores give the commit back, and the remapped tensor's steps leave the commit alone."""

import json

import numpy as np
import pytest

from bench import harness, restore_cow


def test_a_remapped_tensor_reads_the_commit_and_its_writes_stay_private():
    table = restore_cow.Table(8 << 20)
    table.tensor[100:200] = -1.0
    table.restore_remap()
    assert np.array_equal(table.live, table.commit)
    before = table.commit.copy()
    table.tensor.add_(1.0)  # every page, the partial first and last ones included
    assert np.array_equal(table.commit, before)
    assert np.array_equal(table.live, before + 1.0)


def test_the_run_records_every_round_and_the_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS_DIR", str(tmp_path))
    assert restore_cow.main(["--mib", "8", "--slice-mib", "1", "--rounds", "2", "--name", "cow"]) == 0
    result = json.loads((tmp_path / "cow.json").read_text())
    assert [len(result["samples"][m]) for m in ("copy", "remap")] == [2, 2]
    assert set(result["remap_over_copy"]) >= {"restore_s", "sparse_step_s", "dense_step_s"}


def test_a_slice_as_large_as_the_tensor_is_refused_with_both_values(capsys):
    with pytest.raises(SystemExit):
        restore_cow.main(["--mib", "4", "--slice-mib", "4"])
    assert "--mib 4 and --slice-mib 4" in capsys.readouterr().err

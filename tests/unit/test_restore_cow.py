"""bench.restore_cow: both restores give the commit back, and the remapped tensor's steps leave the commit alone."""

import json

import numpy as np
import pytest

from bench import harness, restore_cow


def test_a_remapped_tensor_reads_the_commit_and_its_writes_stay_private():
    table = restore_cow.Table(restore_cow.MIN_MIB << 20)
    table.tensor[100:200] = -1.0            # the partial first page, copied
    table.tensor[1 << 20:(1 << 20) + 100] = -1.0  # a whole page, remapped
    table.restore_remap()
    assert np.array_equal(table.live, table.commit)
    before = table.commit.copy()
    table.tensor.add_(1.0)  # every page, the partial first and last ones included
    assert np.array_equal(table.commit, before)
    assert np.array_equal(table.live, before + 1.0)


def test_the_run_records_every_round_and_the_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS_DIR", str(tmp_path))
    assert restore_cow.main(["--mib", "32", "--slice-mib", "1", "--rounds", "2", "--name", "cow"]) == 0
    result = json.loads((tmp_path / "cow.json").read_text())
    assert [len(result["samples"][m]) for m in ("copy", "remap")] == [2, 2]
    assert set(result["remap_over_copy"]) >= {"restore_s", "sparse_step_s", "dense_step_s"}


@pytest.mark.parametrize("mib, slice_mib", [(40, 40), (8, 1)])
def test_a_slice_as_large_as_the_tensor_or_a_small_tensor_is_refused_with_both_values(capsys, mib, slice_mib):
    with pytest.raises(SystemExit):
        restore_cow.main(["--mib", str(mib), "--slice-mib", str(slice_mib)])
    assert f"--mib {mib} and --slice-mib {slice_mib}" in capsys.readouterr().err


def test_a_table_too_small_for_a_mapping_of_its_own_is_refused_with_its_size():
    with pytest.raises(ValueError, match=r"a table of 8388608 bytes: expected at least 32 MiB"):
        restore_cow.Table(8 << 20)

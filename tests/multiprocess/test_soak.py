"""The soak (bench/soak.py) with a small count: one job, a seeded schedule of 8
faults of every kind (kills at random moments and mid-commit/mid-allreduce,
kills while recovering, SIGSTOP, SIGTERM, host removal and addition), durable
checkpoints on; the job must survive every fault, exactly once, with equal
final parameters on every rank. ``python -m bench.soak --faults 30`` is the
long version."""

import pytest

from bench import soak


@pytest.mark.timeout(900)
def test_soak_small(tmp_path):
    result = soak.soak(str(tmp_path / "soak"), count=8, seed=3, timeout_s=600)
    summary = {k: v for k, v in result.items() if k != "faults"}
    assert result["job_deaths"] == 0, summary
    assert result["faults_injected"] >= 8, summary
    assert result["faults_survived"] == result["faults_injected"], summary
    assert result["samples_duplicated"] == 0 and result["samples_skipped"] == 0, summary
    assert result["exactly_once"], summary
    assert result["final_parameters_identical"], summary

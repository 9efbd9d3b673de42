"""Under elastic-horovodrun a worker waiting for a PyTorch collective sleeps instead of spinning on a core.

Horovod's own wait keeps a core busy per waiting worker, which on shared
cores slows the collective it waits for (bench.engine measures the steps);
elastic_ext.worker.torch_wait replaces it in every worker the launcher
starts. The job: two ranks, rank 0 waits in an allreduce rank 1 joins late.
"""

import json
import os

import pytest

from tests.multiprocess import launch

# Horovod's spin uses a whole core when it has one, and still a large share
# of one beside other jobs on 2 cores; the sleeping wait's polls use ~2 %.
MAX_CPU_FRACTION = 0.15


@pytest.mark.timeout(240)
def test_a_rank_waiting_in_an_allreduce_sleeps_and_gets_the_right_sum(tmp_path):
    hosts = tmp_path / "hosts"
    launch.write_hosts(str(hosts), ["localhost:2"])
    cmd = launch.under_elastic_ext_driver(launch.elastic_cmd(2, 2, 2, str(hosts), "collective_wait.py",
                                                             str(tmp_path)))
    code, output = launch.run(cmd, launch.base_env(), str(tmp_path / "horovodrun.log"), 200)
    assert code == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [[3.0], [3.0]], ranks
    assert all(r["wait_is_elastic_ext"] for r in ranks), ranks
    assert ranks[0]["main_thread_cpu_fraction"] < MAX_CPU_FRACTION, ranks[0]

"""ElasticCallback and the Keras 2/3 gradient API in a world of one (tf_fit_check.py).

Rollbacks here are real ones: a callback raises HorovodInternalError inside
``model.fit`` and ``@elastic_ext.run`` restores, resets Horovod and calls fit
again from the committed epoch and batch. Each Keras version runs in its own
process: TF picks Keras 2 or 3 at import.
"""

import os
import subprocess
import sys

import pytest

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_fit_check.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(CHECK)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("keras", ["2", "3"])
def test_fit_resumes_mid_epoch_bitwise_and_the_gradient_api_checks_its_arguments(keras):
    # The checkout on PYTHONPATH: the check reads its data from examples/digits.py.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_USE_LEGACY_KERAS", None)
    result = subprocess.run([sys.executable, CHECK, keras], capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:]

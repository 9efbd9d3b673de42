"""Exact restore for every TensorFlow adapter, with Keras 2 (tf_keras) and Keras 3.

Each Keras version runs in its own process: TF picks Keras 2 or 3 at import.
"""

import os
import subprocess
import sys

import pytest

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_state_check.py")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("keras", ["2", "3"])
def test_tf_adapters_restore_bitwise(keras):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    result = subprocess.run([sys.executable, CHECK, keras], capture_output=True, text=True, timeout=170, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().startswith("ok"), result.stdout

"""Importing the package changes nothing in the process, even in an elastic worker's environment.

Each import runs in a fresh interpreter whose environment looks like a worker
that an elastic ``horovodrun`` started, with every switch that once acted at
import turned on (restart in place, early start, a rendezvous timeout). The
child records forks, child processes, Horovod's ``init`` and rank queries,
the environment and every signal handler before and after the import.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = r"""
import json, os, signal, sys
import psutil
from horovod.common import basics

forks = []
_fork = os.fork
def recording_fork():
    forks.append(os.getpid())
    return _fork()
os.fork = recording_fork

QUERIES = ("init", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
def horovod():
    return {name: id(getattr(basics.HorovodBasics, name)) for name in QUERIES}
def handlers():
    found = {}
    for sig in signal.valid_signals():
        try:
            found[int(sig)] = repr(signal.getsignal(sig))
        except (OSError, ValueError):
            pass
    return found

import importlib
for name in filter(None, sys.argv[1].split(",")):  # the user's own imports: what they change is not ours
    importlib.import_module(name)
before = {"horovod": horovod(), "env": dict(os.environ), "signals": handlers()}
for name in sys.argv[2].split(","):
    importlib.import_module(name)
after = {"horovod": horovod(), "env": dict(os.environ), "signals": handlers()}
print(json.dumps({
    "forks": forks,
    "children": [p.cmdline() for p in psutil.Process().children(recursive=True)],
    "patched": sorted(k for k in QUERIES if before["horovod"][k] != after["horovod"][k]),
    "env_changed": sorted(k for k in set(before["env"]) | set(after["env"])
                          if before["env"].get(k) != after["env"].get(k)),
    "signals_changed": sorted(k for k in before["signals"] if before["signals"][k] != after["signals"].get(k)),
}))
"""


def worker_env(tmp_path):
    """What a worker of an elastic horovodrun sees, with every import-time switch of the past turned on."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": REPO, "HOROVOD_ELASTIC": "1", "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "2", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        # a port nobody listens on: a patched init would not reach it, and must not try at import
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "9",
        "ELASTIC_EXT_RESTART_IN_PLACE": "1", "ELASTIC_EXT_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "ELASTIC_EXT_PRESTART_NEWCOMERS": "1", "ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S": "200",
        "ELASTIC_EXT_LAUNCHER": "1",
    })
    env.pop("HOROVOD_GLOO_TIMEOUT_SECONDS", None)
    return env


@pytest.mark.parametrize("first, modules", [("", "elastic_ext"), ("torch,horovod.torch", "elastic_ext,elastic_ext.torch"),
                                            ("tensorflow,horovod.tensorflow", "elastic_ext,elastic_ext.tensorflow")])
def test_importing_the_package_forks_patches_writes_and_handles_nothing(tmp_path, first, modules):
    result = subprocess.run([sys.executable, "-c", _CHILD, first, modules], env=worker_env(tmp_path), cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["forks"] == [] and seen["children"] == [], f"import {modules} forked or started processes: {seen}"
    assert seen["patched"] == [], f"import {modules} replaced Horovod's {seen['patched']}"
    assert seen["env_changed"] == [], f"import {modules} changed environment variables {seen['env_changed']}"
    assert seen["signals_changed"] == [], f"import {modules} changed the handlers of signals {seen['signals_changed']}"


def test_the_core_imports_and_works_without_any_framework():
    # A meta-path finder that refuses torch, tensorflow, keras and horovod.
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'tensorflow', 'keras', 'tf_keras', 'horovod'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import torch\n"
        "    raise SystemExit('torch import was not blocked')\n"
        "except ImportError:\n"
        "    pass\n"
        "import elastic_ext, elastic_ext.data.partition, elastic_ext.data.sampler, elastic_ext.discovery\n"
        "from elastic_ext.testing import SoloBinding, state_on\n"
        "s = state_on(SoloBinding(), epoch=3)\n"
        "s.commit(); s.epoch = 4; s.restore(); assert s.epoch == 3\n"
        "print('ok', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'horovod')))\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"

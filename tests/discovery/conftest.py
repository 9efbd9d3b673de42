"""Fixtures for discovery tests against a real Slurm and a real moto EC2 server.

Both are session-scoped: started once (well under a second each), stopped by
PID at the end, also when a test fails or times out.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional

import pytest

from moto_server import MotoServer
from slurm_cluster import SlurmCluster

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "host_discovery"
# Bound for one script run in a test: far above the scripts' own --timeout-s.
SCRIPT_RUN_TIMEOUT_S = 30


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    atexit.register(cluster.stop)  # also when pytest is interrupted
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def moto_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    atexit.register(server.stop)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def moto(moto_session: MotoServer) -> MotoServer:
    """The moto server, emptied before each test."""
    moto_session.reset()
    return moto_session


RunScript = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def run_script() -> RunScript:
    """Run ``host_discovery/NAME.py ARGS`` as Horovod would: an executable, via its shebang."""

    def run(name: str, *args: str, env: Optional[Dict[str, str]] = None,
            timeout: float = SCRIPT_RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
        base = dict(os.environ if env is None else env)
        # `#!/usr/bin/env python3` must find the venv's interpreter, as after `activate`.
        base["PATH"] = str(Path(sys.executable).parent) + os.pathsep + base.get("PATH", "")
        return subprocess.run([str(SCRIPTS / f"{name}.py"), *args], env=base,
                              capture_output=True, text=True, timeout=timeout)

    return run

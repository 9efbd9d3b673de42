"""moto's EC2/Auto Scaling API server as a real process, for discovery tests.

``moto_server`` from the venv serves the AWS query APIs over HTTP; boto3
(and the aws_spot discovery script) talk to it through ``endpoint_url``
with fake credentials, exactly as they would to a VPC endpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional

from procs import die_with_parent

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
REGION = "us-east-1"
# Credentials moto accepts; never real ones.
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    # Keep any ~/.aws config on the test machine out of the picture.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    """One ``moto_server`` process on a free local port."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> "MotoServer":
        exe = Path(sys.executable).with_name("moto_server")
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(self.port)],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          env=dict(os.environ, **FAKE_AWS_ENV),
                                          start_new_session=True, preexec_fn=die_with_parent)
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}: "
                                   f"{self._log_path.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer within {START_TIMEOUT_S} s")

    def reset(self) -> None:
        """Forget every resource (moto's documented reset endpoint)."""
        req = urllib.request.Request(self.url + "/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=5).read()

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except ProcessLookupError:
            pass
        self._proc = None

    def env(self) -> Dict[str, str]:
        """Environment for a discovery subprocess that talks to this server."""
        return dict(os.environ, **FAKE_AWS_ENV)

"""``.ci/run``'s exit status is the first failure's: a setup that fails is a failed CI run, not a green one
with no test run (the README's test command is ``bash tools/setup.sh && .venv/bin/python -m pytest tests``)."""

import os
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake_checkout(tmp_path, setup_status, pytest_status):
    """A checkout with the real ``.ci/run``, a setup that exits ``setup_status`` and a venv whose python
    records its arguments and exits ``pytest_status``."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, ".ci", "run"), tmp_path / ".ci" / "run")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "setup.sh").write_text(f"echo setup ran\nexit {setup_status}\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/pytest-args"\nexit {pytest_status}\n')
    python.chmod(0o755)
    return tmp_path


def run_ci(checkout):
    return subprocess.run(["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, timeout=60)


def test_a_failed_setup_fails_ci_and_runs_no_test(tmp_path):
    result = run_ci(fake_checkout(tmp_path, setup_status=3, pytest_status=0))
    assert result.returncode == 3, result.stdout + result.stderr
    assert not (tmp_path / "pytest-args").exists(), "pytest ran after a failed setup"
    assert "exit status 3" in result.stdout


def test_a_failed_suite_fails_ci_and_a_passing_one_passes(tmp_path):
    failing = run_ci(fake_checkout(tmp_path / "failing", setup_status=0, pytest_status=1))
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert (tmp_path / "failing" / "pytest-args").read_text().split() == ["-m", "pytest", "tests"]
    passing = run_ci(fake_checkout(tmp_path / "passing", setup_status=0, pytest_status=0))
    assert passing.returncode == 0, passing.stdout + passing.stderr

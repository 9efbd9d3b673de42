"""devkit.cpu_report: each test's CPU, its children's included, one JSON line per test, and the summary."""

import json
import subprocess
import sys
import textwrap

from devkit import cpu_report
from tests.conftest import REPO


def test_each_test_gets_a_line_with_the_cpu_of_the_children_it_waited_for(tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import subprocess, sys

        def test_spins_a_child():
            subprocess.run([sys.executable, "-c",
                            "import time\\nwhile time.process_time() < 0.3: pass"], check=True)

        def test_does_nothing():
            pass
    """))
    report = tmp_path / "cpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "devkit.cpu_report",
                           "--cpu-report", str(report), "-o", "addopts=", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_inner.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["id"].split("::")[-1]: row for row in map(json.loads, report.read_text().splitlines())}
    assert sorted(rows) == ["test_does_nothing", "test_spins_a_child"]
    assert rows["test_spins_a_child"]["cpu_s"] >= 0.3, rows  # the child's 0.3 s of CPU, at least
    assert rows["test_does_nothing"]["cpu_s"] < rows["test_spins_a_child"]["cpu_s"], rows

    lines = cpu_report.summary(str(report))
    assert lines[0].endswith("2 tests"), lines
    assert any(line.split()[-1].endswith("test_inner.py") and line.split()[2] == "2" for line in lines), lines


def test_without_the_option_nothing_is_written(tmp_path):
    (tmp_path / "test_inner.py").write_text("def test_a():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "devkit.cpu_report",
                           "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": REPO, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["test_inner.py"]

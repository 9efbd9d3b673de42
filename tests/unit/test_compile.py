"""Every tracked Python file compiles on the pinned interpreter.

The README's main job once shipped with syntax that only Python 3.12 accepts
(nested same-kind quotes in an f-string) while the environment is pinned to
3.11: no test imported the demo, so nothing noticed. Compiling every file
catches that class of break without running it.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tracked_python_files():
    """The repository's tracked ``*.py`` files (every ``*.py`` outside .venv/.git if not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
        files = [line for line in out.stdout.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in (".git", ".venv", "__pycache__")]
            files += [os.path.relpath(os.path.join(top, n), REPO) for n in names if n.endswith(".py")]
    return sorted(files)


def test_the_file_list_covers_the_project():
    files = tracked_python_files()
    for expected in ("examples/run_demo.py", "examples/pytorch_elastic.py", "elastic_ext/state/state.py", "setup.py"):
        assert expected in files, f"{expected} missing from the compiled files: {files[:10]}..."


def test_every_file_compiles():
    failures = []
    for path in tracked_python_files():
        with open(os.path.join(REPO, path), "rb") as handle:
            source = handle.read()
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            failures.append(f"{path}:{exc.lineno}: {exc.msg}:\n{exc.text}")
    assert not failures, f"{len(failures)} file(s) do not compile on Python {sys.version.split()[0]}:\n" + \
        "\n".join(failures)

"""The repository stands on its own: no tracked file points at notes kept beside it."""

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Written in pieces so that this file does not match itself.
OUTSIDE = ("../" + "shared", "shared/" + "notes", "/work/" + "shared")


def test_no_tracked_file_refers_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 50, files
    offenders = []
    for path in files:
        try:
            with open(os.path.join(REPO, path), encoding="utf-8") as handle:
                text = handle.read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary (PNG results) or deleted in the work tree
        offenders += [f"{path}: {needle}" for needle in OUTSIDE if needle in text]
    assert not offenders, f"files that refer outside the repository: {offenders}"

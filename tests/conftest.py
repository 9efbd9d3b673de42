"""Shared pytest setup: the repository root goes first on sys.path, so tests
import ``tests.*`` and this checkout's elastic_ext (not an installed copy).

Every test's hard timeout comes from pytest-timeout: ``timeout`` in
pytest.ini for all of them, or the test's own ``pytest.mark.timeout``.
Jobs launched by the job tiers start no hang guardian unless the test asks
for one (:func:`no_guardian_unless_hangs_are_tested`).
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

JOB_TIERS = tuple(os.path.join(REPO, "tests", tier) for tier in ("multiprocess", "discovery", "multihost"))


@pytest.fixture(autouse=True)
def no_guardian_unless_hangs_are_tested(request, monkeypatch):
    """Jobs of tests/multiprocess, tests/discovery and tests/multihost start no guardian per worker.

    The guardian (one more Python process per worker) is there for hangs;
    the tests of hangs set ``ELASTIC_EXT_HANG_TIMEOUT_S`` themselves, and a
    module that runs what users run with the defaults (the README's demo,
    the examples) says ``USER_DEFAULTS = True``.
    """
    if str(request.path).startswith(JOB_TIERS) and not getattr(request.module, "USER_DEFAULTS", False):
        monkeypatch.setenv("ELASTIC_EXT_HANG_TIMEOUT_S", "0")

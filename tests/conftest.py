"""Shared pytest setup: the repository root goes first on sys.path, so tests
import ``tests.*`` and this checkout's elastic_ext (not an installed copy).

Every test's hard timeout comes from pytest-timeout: ``timeout`` in
pytest.ini for all of them, or the test's own ``pytest.mark.timeout``.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

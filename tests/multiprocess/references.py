"""Failure-free reference runs, launched once per test session and shared.

Several tests compare a failed job with a failure-free run that follows the
same world sizes; where two tests need the same reference (the same worker
and the same arguments), it is one launch. A test module imports the
``references`` fixture and asks for a run by a key naming everything the run
depends on:

    from tests.multiprocess.references import references  # noqa: F401  (the fixture)

    def test_x(tmp_path, references):
        ref = references.get(("train_torch.py", "adam", 8), lambda directory: run(directory, ...))

A launch that fails is not kept: its exception fails the test that asked,
and the next test with that key launches again.
"""

from typing import Any, Callable, Dict, Hashable

import pytest


# One cache per test process: a module that imports the fixture gets a fixture
# of its own (pytest keeps one per module that defines it), and every one of
# them must find the runs the others launched.
_RUNS: Dict[Hashable, Any] = {}


class References:
    """Runs keyed by what they depend on, each in its own session directory."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._runs = _RUNS

    def get(self, key: Hashable, launch: Callable[[Any], Any]) -> Any:
        """``launch(directory)``'s result for ``key``; launched only the first time ``key`` is asked for."""
        if key not in self._runs:
            self._runs[key] = launch(self._factory.mktemp("reference"))
        return self._runs[key]


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory)

"""Shared pytest setup: the repository root goes first on sys.path, so tests
import ``tests.*`` and this checkout's elastic_ext (not an installed copy).

Every test's hard timeout comes from pytest-timeout: ``timeout`` in
pytest.ini for all of them, or the test's own ``pytest.mark.timeout``.
Jobs launched by the job tiers start no hang guardian unless the test asks
for one (:func:`no_guardian_unless_hangs_are_tested`).

How the suite shares the machine (pytest-xdist, ``-n`` in pytest.ini): the
job tiers (every directory of tests/ but tests/unit) run one test at a time,
in one worker (:class:`TierScheduler`), because their jobs keep both cores
busy; the unit tier runs beside them. A test marked ``exclusive`` (it gives
a detector a short timeout, or its assertion needs the machine quiet) runs
alone: it waits for the running tests to end, and no test starts until it
ends (:func:`pytest_runtest_protocol`).
"""

import fcntl
import os
import shutil
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

UNIT_TIER = os.path.join(REPO, "tests", "unit")
JOB_TIERS_SCOPE = "job tiers"


def in_a_job_tier(path):
    """True for a test file of tests/multiprocess, tests/discovery or any other tier of jobs (not tests/unit)."""
    path = os.path.abspath(str(path))
    return path.startswith(os.path.join(REPO, "tests") + os.sep) and not path.startswith(UNIT_TIER + os.sep)


@pytest.fixture(autouse=True)
def no_guardian_unless_hangs_are_tested(request, monkeypatch):
    """Jobs of the job tiers (tests/multiprocess, tests/discovery, tests/multihost) start no guardian per worker.

    The guardian (one more Python process per worker) is there for hangs;
    the tests of hangs set ``ELASTIC_EXT_HANG_TIMEOUT_S`` themselves, and a
    module that runs what users run with the defaults (the README's demo,
    the examples) says ``USER_DEFAULTS = True``.
    """
    if in_a_job_tier(request.path) and not getattr(request.module, "USER_DEFAULTS", False):
        monkeypatch.setenv("ELASTIC_EXT_HANG_TIMEOUT_S", "0")


class TierScheduler:
    """pytest-xdist's load-by-scope scheduling, with every test of the job tiers in one scope.

    One scope runs in one worker, in collection order; the unit tier's
    modules are scopes of their own and fill the other workers.
    """

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class TierScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                path = nodeid.split("::", 1)[0]
                return JOB_TIERS_SCOPE if in_a_job_tier(os.path.join(str(config.rootpath), path)) else path

        return TierScheduling(config, log)


# The directory of the locks by which the workers of one pytest-xdist run share the machine.
ROOM_ENV = "PYTEST_ELASTIC_EXT_ROOM"  # not ELASTIC_EXT_*: the workers would take it for a setting


def pytest_configure(config):
    config.addinivalue_line("markers", "exclusive: runs alone on the machine, even under pytest-xdist "
                                       "(a detector with a short timeout, an assertion that needs it quiet)")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(TierScheduler(), "elastic-ext-tier-scheduler")
        if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
            # The controller, before it starts its workers (they inherit the variable).
            config._elastic_ext_room = tempfile.mkdtemp(prefix="elastic_ext-tests-")
            os.environ[ROOM_ENV] = config._elastic_ext_room


def pytest_unconfigure(config):
    room = getattr(config, "_elastic_ext_room", None)
    if room:
        shutil.rmtree(room, ignore_errors=True)
        os.environ.pop(ROOM_ENV, None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist: tests share the machine, but an ``exclusive`` one runs alone.

    Every test holds the room shared, an exclusive test holds it alone. A
    turnstile that an exclusive test holds while it waits for the room keeps
    new tests from entering meanwhile (fcntl locks favour no one). The wait
    comes before the test's own timeout starts (this wraps pytest-timeout's
    hook).
    """
    directory = os.environ.get(ROOM_ENV)
    if not directory or not hasattr(item.config, "workerinput"):
        yield
        return
    with open(os.path.join(directory, "turnstile"), "a") as turnstile, \
            open(os.path.join(directory, "room"), "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if item.get_closest_marker("exclusive") is not None:
            fcntl.flock(room, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)

"""Shared pytest setup: the repository root goes first on sys.path, so tests
import ``tests.*`` and this checkout's elastic_ext (not an installed copy).

Every test's hard timeout comes from pytest-timeout: ``timeout`` in
pytest.ini for all of them, or the test's own ``pytest.mark.timeout``.
Jobs launched by the job tiers start no hang guardian unless the test asks
for one (:func:`no_guardian_unless_hangs_are_tested`).

How the suite shares the machine (pytest-xdist, ``-n`` in pytest.ini): two
workers, each running one scope at a time (:class:`TierScheduler`): a
module, or a directory whose tests share one cluster. The job tiers' scopes
go first (FIRST_SCOPES), so two jobs run at once for most of the run and the
unit tier's modules fill the end. A test marked ``exclusive`` (it
gives a detector a short timeout, or its assertion needs the machine quiet)
runs alone: it waits for the running tests to end, and no test starts until
it ends (:func:`pytest_runtest_protocol`).
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
    """pytest-xdist's load-by-scope scheduling: one scope runs in one worker, in collection order.

    A scope is a module, or a directory whose tests share a session-wide
    cluster (:func:`scope_of`), so a module's session fixtures (a reference
    run, a cluster) are made once. Scopes are taken in collection order
    (:func:`pytest_collection_modifyitems`: see FIRST_SCOPES), and a
    worker takes its next scope as it starts the last test of the one it
    has, not two scopes ahead: jobs run two at a time, the unit tier's
    modules fill the end, and the workers end together.
    """

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # the collection's order (by size otherwise)

        class TierScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return scope_of(nodeid)

            def _reschedule(self, node):
                # A worker runs a test once it knows the next one: with one test left it needs more.
                if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                    return
                super()._reschedule(node)

        return TierScheduling(config, log)


# The order in which the job tiers' scopes are taken (measured on 2 cores): those
# that begin with exclusive tests first, so that those run while the other
# worker has not started a long job to wait for (and a worker's consecutive
# exclusive tests keep the room), then the longest first, so that the workers
# end together. A scope not listed runs after these; the unit tier's modules last.
FIRST_SCOPES = (
    "tests/multiprocess/test_lifecycle.py",   # 2 exclusive, then 6 jobs
    "tests/multiprocess/test_detection.py",   # 1 exclusive
    "tests/multiprocess/test_zoo.py",         # 2 exclusive, then 2 jobs
    "tests/multihost",
    "tests/multiprocess/test_keras_fit.py",
    "tests/discovery",
    "tests/multiprocess/test_horovod_scenarios.py",
    "tests/multiprocess/test_torch_elastic.py",
    "tests/multiprocess/test_prestart.py",
    "tests/multiprocess/test_tf_checkpoint_resume.py",
    "tests/multiprocess/test_demo.py",
    "tests/multiprocess/test_resize.py",
    "tests/multiprocess/test_checkpoint_resume.py",
    "tests/multiprocess/test_examples.py",
    "tests/multiprocess/test_replica.py",
    "tests/multiprocess/test_numeric_guard.py",
)


def scope_of(nodeid):
    """The unit of scheduling of a test: its directory where the tests share a session-wide
    cluster (tests/discovery's Slurm, tests/multihost's hosts), else its module."""
    path = nodeid.split("::", 1)[0]
    for shared in ("tests/discovery", "tests/multihost"):
        if path.startswith(shared + "/"):
            return shared
    return path


def pytest_collection_modifyitems(session, config, items):
    """The job tiers' scopes in the order of FIRST_SCOPES, the other job scopes next, the unit tier last."""
    def rank(item):
        scope = scope_of(item.nodeid)
        if not in_a_job_tier(item.path):
            return 2, 0
        return (0, FIRST_SCOPES.index(scope)) if scope in FIRST_SCOPES else (1, 0)
    items.sort(key=rank)  # stable: a scope's tests keep their order


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


# The room, held alone from one exclusive test to the next exclusive test of this worker.
_ALONE = []


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist: tests share the machine, but an ``exclusive`` one runs alone.

    Every test holds the room shared, an exclusive test holds it alone. A
    turnstile that an exclusive test holds while it waits for the room keeps
    new tests from entering meanwhile (fcntl locks favour no one). Exclusive
    tests that follow each other in a worker keep the room from one to the
    next: one wait for the other worker's test, not one each. The wait comes
    before the test's own timeout starts (this wraps pytest-timeout's hook).
    """
    directory = os.environ.get(ROOM_ENV)
    if not directory or not hasattr(item.config, "workerinput"):
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    room = _ALONE.pop() if _ALONE else None  # held since the previous test, exclusive too
    if room is None:
        room = open(os.path.join(directory, "room"), "a")
        with open(os.path.join(directory, "turnstile"), "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            if exclusive:
                fcntl.flock(room, fcntl.LOCK_EX)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            else:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                fcntl.flock(room, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if exclusive and nextitem is not None and nextitem.get_closest_marker("exclusive") is not None:
            _ALONE.append(room)  # the next test needs the room alone too: no wait for the others' tests
        else:
            fcntl.flock(room, fcntl.LOCK_UN)
            room.close()

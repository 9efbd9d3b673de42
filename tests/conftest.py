"""Shared pytest setup: the repository root goes first on sys.path, so tests
import ``tests.*`` and this checkout's elastic_ext (not an installed copy).

Every test's hard timeout comes from pytest-timeout: ``timeout`` in
pytest.ini for all of them, or the test's own ``pytest.mark.timeout``.
Jobs launched by the job tiers start no hang guardian unless the test asks
for one (:func:`no_guardian_unless_hangs_are_tested`).

How the suite shares the machine (pytest-xdist, ``-n`` in pytest.ini): three
workers, each running one scope at a time (:class:`TierScheduler`): a
module, a directory whose tests share one cluster, or all the tests marked
``exclusive`` (a detector with a short timeout, or an assertion that needs
the machine quiet). Those run first, one worker running them one after the
other (the unit tier's first) while the other two run the unit tier's modules
beside them; then the job tiers' scopes (FIRST_SCOPES), two at a time
(JOBS_AT_ONCE), tests/multihost, which mostly waits, beside them
(WAITING_SCOPES): the third worker ends when only scopes of jobs are left
that would take a place. An exclusive test runs
alone among the jobs: it waits for the running job to end, and no job
starts until it ends (:func:`pytest_runtest_protocol`). Unit tests (one
light process each) run beside anything.
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

# Jobs under plain Horovod run Horovod's own runner with its build checks answered from the launcher's
# cache (elastic_ext.launch.plain_horovodrun): about 3 s of a core less per job. Horovod's elastic
# scenarios (test_horovod_scenarios.py) and the Slurm-driven job run the horovodrun script itself.
from devkit import launch as _launch  # noqa: E402

_launch.RUNNER = _launch.CACHED_CHECKS

# Every Python process the suite starts collects garbage less often and skips the collections at its exit
# (devkit/suite_python/sitecustomize.py): about 2 s of a core less per PyTorch worker. Set before
# pytest-xdist starts its workers, which inherit it with the jobs they launch.
SUITE_PYTHON = os.path.join(REPO, "devkit", "suite_python")
if SUITE_PYTHON not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUITE_PYTHON, os.environ.get("PYTHONPATH")) if p)


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

    A scope (:func:`scope_of`) is a module, a directory whose tests share a
    session-wide cluster (so a module's session fixtures, a reference run or
    a cluster, are made once), or all the exclusive tests (listed by the
    workers at collection: :func:`pytest_collection_modifyitems`). Scopes
    are taken in collection order, and a worker takes its next scope as it
    starts the last test of the one it has, not two scopes ahead, so the
    workers end together.
    """

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # the collection's order (by size otherwise)
        exclusive = []  # read once, when the workers have collected

        class TierScheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                if not exclusive:
                    exclusive.append(read_exclusive_ids())
                return EXCLUSIVE_SCOPE if nodeid in exclusive[0] else scope_of(nodeid)

            def _reschedule(self, node):
                # A worker runs a test once it knows the next one: with one test left it needs more.
                if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                    return
                super()._reschedule(node)

            def _assign_work_unit(self, node):
                # The first scope in order, unless two other workers run jobs: then the first unit
                # module, and with none left this worker ends (what is left runs two at a time).
                busy = sum(1 for other, work in self.assigned_work.items() if other is not node and any(
                    takes_a_job_place(scope) and not all(done.values()) for scope, done in work.items()))
                scope = next((s for s in self.workqueue if busy < JOBS_AT_ONCE or not takes_a_job_place(s)), None)
                if scope is None:
                    node.shutdown()
                    return
                self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        return TierScheduling(config, log)


EXCLUSIVE_SCOPE = "exclusive"

# Scopes that launch jobs (the exclusive tests included) run at most this many at a time: a third
# job beside two slows all three and costs more CPU (docs/testing.md). The unit tier's modules, one
# light process each, fill the remaining worker (``-n`` in pytest.ini).
JOBS_AT_ONCE = 2


# Scopes of jobs that mostly wait (tests/multihost's partitions, timeouts and ssh round trips: about a
# third of a core over its three minutes) run beside two others without taking a place of theirs.
WAITING_SCOPES = ("tests/multihost",)


def takes_a_job_place(scope):
    return scope not in WAITING_SCOPES and (scope == EXCLUSIVE_SCOPE or in_a_job_tier(os.path.join(REPO, scope)))


# The order in which the job tiers' scopes are taken after the exclusive tests
# and the unit tier (measured on 2 cores): the longest first, so that the
# workers end together. A scope not listed runs after these.
FIRST_SCOPES = (
    "tests/multiprocess/test_corpus.py",
    "tests/multiprocess/test_keras_fit.py",
    "tests/multihost",
    "tests/multiprocess/test_lifecycle.py",
    "tests/multiprocess/test_horovod_scenarios.py",
    "tests/multiprocess/test_resize.py",
    "tests/multiprocess/test_prestart.py",
    "tests/multiprocess/test_torch_elastic.py",
    "tests/multiprocess/test_tf_checkpoint_resume.py",
    "tests/discovery",
    "tests/multiprocess/test_checkpoint_resume.py",
    "tests/multiprocess/test_demo.py",
    "tests/multiprocess/test_examples.py",
    "tests/multiprocess/test_replica.py",
    "tests/multiprocess/test_zoo.py",
    "tests/multiprocess/test_numeric_guard.py",
)


def scope_of(nodeid):
    """The unit of scheduling of a test that is not exclusive: its directory where the tests share a
    session-wide cluster (tests/discovery's Slurm, tests/multihost's hosts), else its module."""
    path = nodeid.split("::", 1)[0]
    for shared in ("tests/discovery", "tests/multihost"):
        if path.startswith(shared + "/"):
            return shared
    return path


def pytest_collection_modifyitems(session, config, items):
    """The exclusive tests first, the unit tier next, then the job tiers' scopes in the order of
    FIRST_SCOPES and the other job scopes. A pytest-xdist worker lists the exclusive tests for the
    scheduler (every worker collects the same tests)."""
    def rank(item):
        if item.get_closest_marker("exclusive") is not None:
            # The unit tier's exclusive tests (light, mostly waiting) first, while the unit tier's
            # modules run beside them; then the exclusive tests of the job tiers.
            return 0, 1 if in_a_job_tier(item.path) else 0
        if not in_a_job_tier(item.path):
            return 1, 0
        scope = scope_of(item.nodeid)
        return (2, FIRST_SCOPES.index(scope)) if scope in FIRST_SCOPES else (3, 0)
    items.sort(key=rank)  # stable: a scope's tests keep their order
    directory = os.environ.get(ROOM_ENV)
    if directory and hasattr(config, "workerinput"):
        listing = os.path.join(directory, f"exclusive-{config.workerinput['workerid']}")
        with open(listing + ".tmp", "w") as handle:
            handle.writelines(item.nodeid + "\n" for item in items if item.get_closest_marker("exclusive"))
        os.replace(listing + ".tmp", listing)


def read_exclusive_ids():
    """The node ids of the exclusive tests, as the workers listed them (empty without a room)."""
    directory = os.environ.get(ROOM_ENV)
    ids = set()
    if directory:
        for name in os.listdir(directory):
            if name.startswith("exclusive-") and not name.endswith(".tmp"):
                with open(os.path.join(directory, name)) as handle:
                    ids.update(line.strip() for line in handle if line.strip())
    return ids


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

    Every job holds the room shared, an exclusive test holds it alone, a
    unit test that is not exclusive does not take it (it runs beside anything). A
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
    if not exclusive and not in_a_job_tier(item.path):
        yield
        return
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

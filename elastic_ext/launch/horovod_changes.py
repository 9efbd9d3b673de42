"""The seam's other half: the one module that changes anything of Horovod, and the order it does it in.

:mod:`elastic_ext.launch.horovod_seam` checks, before this module runs,
that the installed Horovod has every attribute listed there. Here every
change is made: each module that changes Horovod's behaviour says what it
would change (a function returning :data:`Change` tuples, or a subclass of
Horovod's own class), and :func:`install_launcher` (the driver's process)
and :func:`install_worker` (a worker, before its script) make those
changes, in a fixed order, recording each original in :data:`REPLACED`.

The launcher's changes, in order (:data:`LAUNCHER_PARTS`):

1. ``store_guard``: the store serves the job's hosts only, loads no pickle,
   takes the launcher's keys only with the job's secret.
2. ``store_serving``: a listen queue for bursts; threads reused.
3. ``noticed_hosts``: preemption notices reach the driver through its store.
4. ``driver``: Horovod's elastic Gloo run builds the launcher's driver
   (:func:`elastic_ext.launch.driver.driver_class`, one subclass of
   ``ElasticDriver``; its discovery and its clients of the workers'
   services are the launcher's too).
5. ``worker_runs``: each worker's command a plain child of the driver.
6. ``ssh_keepalive``: keepalives and the ``ssh_host_keys`` check in ssh.
7. ``build_check``: Horovod's build checks answered from a cache.
8. ``worker_entry``: every worker starts through the worker entry.

A worker's, in order (:func:`install_worker`): one wrapper of
``HorovodBasics.init`` that runs (a) the newcomer's early start and the
keeper's round watch around Horovod's ``init`` (in a worker of an elastic
``horovodrun``: :func:`elastic_ext.launch.newcomer.init`), then (b) the
PyTorch extension's collective wait replaced once that extension is
loaded (:mod:`elastic_ext.launch.torch_wait`); the rank and size queries
of a newcomer running solo; the names the imported ``horovod`` modules
bound from them; and the driver's job notices taken by Horovod's
notification service (:func:`elastic_ext.launch.notices.job_notice_handler`).

Nothing here is undone by the product: a process installs once, for its
life.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from elastic_ext.launch.horovod_seam import Change

#: Every change made in this process: ``(owner, name) -> Horovod's original``.
REPLACED: Dict[Tuple[Any, str], Any] = {}
#: The parts of :data:`LAUNCHER_PARTS` installed in this process.
INSTALLED: Set[str] = set()

LAUNCHER_PARTS: Tuple[str, ...] = ("store_guard", "store_serving", "noticed_hosts", "driver", "worker_runs",
                                   "ssh_keepalive", "build_check", "worker_entry")


def _make(changes: Iterable[Change]) -> None:
    for owner, name, value in changes:
        REPLACED.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, value)


def _launcher_changes(part: str, resolver: Optional[Callable[[str], FrozenSet[str]]],
                      host_keys: Optional[str]) -> List[Change]:
    from elastic_ext.launch import (build_check, command_line, driver, noticed_hosts, ssh_keepalive, store_guard,
                                    store_serving, worker_runs)

    if part == "driver":
        from horovod.runner import gloo_run
        return [(gloo_run, "ElasticDriver", driver.driver_class())]
    made: Mapping[str, Callable[[], List[Change]]] = {
        "store_guard": lambda: store_guard.changes(resolver),
        "store_serving": store_serving.changes,
        "noticed_hosts": noticed_hosts.changes,
        "worker_runs": worker_runs.changes,
        "ssh_keepalive": lambda: ssh_keepalive.changes(host_keys),
        "build_check": build_check.changes,
        "worker_entry": command_line.worker_entry_changes,
    }
    return made[part]()


def install_launcher(parts: Sequence[str] = LAUNCHER_PARTS, resolver: Optional[Callable[[str], FrozenSet[str]]] = None,
                     host_keys: Optional[str] = None) -> None:
    """Makes the launcher's changes in this (the driver's) process, in the order of :data:`LAUNCHER_PARTS`;
    a part already installed is left as it is.

    ``parts``: which (tests make only those they test); ``resolver``: host name -> addresses for the
    store guard (default: DNS); ``host_keys``: the ssh host key check (default: the ``ssh_host_keys``
    setting).

    Raises:
        ValueError: an unknown part.
        ConfigError: the ``ssh_host_keys`` setting, or another ``ELASTIC_EXT_*`` variable, is bad.
    """
    unknown = sorted(set(parts) - set(LAUNCHER_PARTS))
    if unknown:
        raise ValueError(f"parts {unknown}: expected some of {list(LAUNCHER_PARTS)}")
    for part in LAUNCHER_PARTS:
        if part in parts and part not in INSTALLED:
            _make(_launcher_changes(part, resolver, host_keys))
            INSTALLED.add(part)


def replace_torch_wait() -> bool:
    """Replaces the PyTorch extension's collective wait by :func:`elastic_ext.launch.torch_wait.waiting`, if that
    extension is loaded; True if it is (now) replaced."""
    from elastic_ext.launch import torch_wait

    lib = sys.modules.get(torch_wait.EXTENSION)
    if lib is None or not hasattr(lib, torch_wait.WAIT) or not hasattr(lib, torch_wait.POLL):
        return False
    if (lib, torch_wait.WAIT) not in REPLACED:
        wait = torch_wait.waiting(getattr(lib, torch_wait.POLL), getattr(lib, torch_wait.WAIT))
        _make([(lib, torch_wait.WAIT, wait)])
    return True


def install_worker(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Makes a worker's changes (the module docstring), before its script; False where Horovod is not installed.

    Installs once: a second call returns True and changes nothing.
    """
    from elastic_ext.launch import newcomer, notices

    try:
        from horovod.common import basics
    except ImportError:
        return False
    cls = basics.HorovodBasics
    if (cls, "init") in REPLACED:
        return True
    elastic = newcomer.wraps_init(environ)
    original, original_local_rank = cls.init, cls.local_rank

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        horovod_init = functools.partial(original, self, *args, **kwargs)
        result = newcomer.init(horovod_init, lambda: original_local_rank(self), hold_global_ranks) if elastic \
            else horovod_init()
        replace_torch_wait()  # `import horovod.torch` loaded it, and every collective comes after an init
        return result

    changes: List[Change] = [(cls, "init", init)]
    if elastic:
        changes += [(cls, name, newcomer.query(name, getattr(cls, name))) for name in newcomer.QUERIES]
    _make(changes)
    if elastic:
        names = ("init", *newcomer.QUERIES)
        _rebind_imported(names, {getattr(cls, name).__wrapped__: getattr(cls, name) for name in names})
        from horovod.runner.elastic.worker import WorkerNotificationService
        _make([(WorkerNotificationService, "_handle", notices.job_notice_handler(WorkerNotificationService._handle))])
    return True


def _rebind_imported(names: Sequence[str], wrapped: Dict[Any, Any]) -> None:
    """The ``names`` the imported ``horovod`` modules bound from ``HorovodBasics`` (``hvd.rank`` is one), bound
    to the wrappers in ``wrapped`` (Horovod's function -> its wrapper)."""
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] != "horovod":
            continue
        for name in names:
            bound = getattr(module, name, None)
            if isinstance(bound, types.MethodType) and bound.__func__ in wrapped:
                _make([(module, name, types.MethodType(wrapped[bound.__func__], bound.__self__))])


def hold_global_ranks(size: int) -> None:
    """For a newcomer running solo (:func:`elastic_ext.launch.newcomer.start_solo`): Horovod's global process
    set holds every launched rank, so that ``DistributedOptimizer`` registers its hooks."""
    from horovod.common.process_sets import global_process_set

    global_process_set.ranks = list(range(size))


__all__ = ["Change", "INSTALLED", "LAUNCHER_PARTS", "REPLACED", "hold_global_ranks", "install_launcher",
           "install_worker", "replace_torch_wait"]

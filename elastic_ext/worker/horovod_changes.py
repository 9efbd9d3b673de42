"""The worker's half of the seam: every change a worker makes to Horovod before its script, and their order.

:mod:`elastic_ext.control.horovod_seam` checks the worker's Horovod first
(:func:`elastic_ext.worker.entry.check_horovod`) and records every change
made (:data:`~elastic_ext.control.horovod_seam.REPLACED`).
:func:`install_worker` makes, in order: one wrapper of
``HorovodBasics.init`` that runs (a) the newcomer's early start and the
keeper's round watch around Horovod's ``init`` (in a worker of an elastic
``horovodrun``: :func:`elastic_ext.worker.newcomer.init`), then (b) the
PyTorch extension's collective wait replaced once that extension is
loaded (:mod:`elastic_ext.worker.torch_wait`); the rank and size queries
of a newcomer running solo; the names the imported ``horovod`` modules
bound from them; and the driver's job notices taken by Horovod's
notification service (:func:`elastic_ext.worker.notices.job_notice_handler`).
The launcher's changes are :mod:`elastic_ext.launch.horovod_changes`.
Nothing here is undone by the product: a process installs once, for its life.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Dict, List, Mapping, Optional, Sequence

from elastic_ext.control.horovod_seam import REPLACED, Change, make


def replace_torch_wait() -> bool:
    """Replaces the PyTorch extension's collective wait by :func:`elastic_ext.worker.torch_wait.waiting`, if that
    extension is loaded; True if it is (now) replaced."""
    from elastic_ext.worker import torch_wait

    lib = sys.modules.get(torch_wait.EXTENSION)
    if lib is None or not hasattr(lib, torch_wait.WAIT) or not hasattr(lib, torch_wait.POLL):
        return False
    if (lib, torch_wait.WAIT) not in REPLACED:
        wait = torch_wait.waiting(getattr(lib, torch_wait.POLL), getattr(lib, torch_wait.WAIT))
        make([(lib, torch_wait.WAIT, wait)])
    return True


def install_worker(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Makes a worker's changes (the module docstring), before its script; False where Horovod is not installed.

    Installs once: a second call returns True and changes nothing.
    """
    from elastic_ext.worker import newcomer, notices

    try:
        from horovod.common import basics
    except ImportError:
        return False
    cls = basics.HorovodBasics
    if (cls, "init") in REPLACED:
        return True
    elastic = newcomer.wraps_init(environ)
    original, original_local_rank, original_size = cls.init, cls.local_rank, cls.size

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        horovod_init = functools.partial(original, self, *args, **kwargs)
        result = newcomer.init(horovod_init, lambda: original_local_rank(self), lambda: original_size(self),
                               hold_global_ranks) if elastic else horovod_init()
        replace_torch_wait()  # `import horovod.torch` loaded it, and every collective comes after an init
        return result

    changes: List[Change] = [(cls, "init", init)]
    if elastic:
        changes += [(cls, name, newcomer.query(name, getattr(cls, name))) for name in newcomer.QUERIES]
    make(changes)
    if elastic:
        names = ("init", *newcomer.QUERIES)
        _rebind_imported(names, {getattr(cls, name).__wrapped__: getattr(cls, name) for name in names})
        from horovod.runner.elastic.worker import WorkerNotificationService
        make([(WorkerNotificationService, "_handle", notices.job_notice_handler(WorkerNotificationService._handle))])
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
                make([(module, name, types.MethodType(wrapped[bound.__func__], bound.__self__))])


def hold_global_ranks(size: int) -> None:
    """For a newcomer running solo (:func:`elastic_ext.worker.newcomer.start_solo`): Horovod's global process
    set holds every launched rank, so that ``DistributedOptimizer`` registers its hooks."""
    from horovod.common.process_sets import global_process_set

    global_process_set.ranks = list(range(size))


__all__ = ["hold_global_ranks", "install_worker", "replace_torch_wait"]

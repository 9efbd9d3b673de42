"""Horovod's build checks, answered from a cache in the launcher's process.

Before it starts a worker, ``horovodrun`` asks whether Horovod was built with
Gloo (an elastic job) or MPI (a static one). Horovod answers by forking a
process that imports each framework's extension in turn, TensorFlow first:
about 3 s of importing TensorFlow before every job starts, on this project's
2-core test machine. The answer only changes when Horovod's extensions do, so
the launcher keeps it in ``~/.cache/elastic_ext/horovod_build.json`` (or under
``$XDG_CACHE_HOME``), keyed by the extension files' paths, sizes and
modification times, and asks Horovod only when they changed. A cache that
cannot be read or written is ignored: Horovod is asked, as without it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Callable, Dict, List, Optional

from elastic_ext.control.horovod_seam import Change

logger = logging.getLogger(__name__)

CHECKS = ("gloo_built", "mpi_built")  # the names horovod.runner.launch calls


def cache_path(env: Optional[Dict[str, str]] = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastic_ext", "horovod_build.json")


def extensions_key(horovod_dir: str) -> str:
    """What the checks' answers depend on: every extension library of Horovod, by path, size and mtime."""
    parts = []
    for path in sorted(glob.glob(os.path.join(horovod_dir, "*", "mpi_lib*"))):
        stat = os.stat(path)
        parts.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def _read(path: str) -> Dict[str, Any]:
    try:
        with open(path) as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, data: Dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}"
        with open(temporary, "w") as handle:
            json.dump(data, handle)
        os.replace(temporary, path)
    except OSError as exc:
        logger.debug("cannot write the build-check cache %s: %s", path, exc)


def cached(name: str, check: Callable[..., Any], key: str, path: str) -> Callable[..., Any]:
    """``check`` (Horovod's ``name``), answered from the cache at ``path`` while ``key`` is unchanged.

    Only a plain answer (True, False or None) is kept; a verbose call asks Horovod (it prints its steps).
    """
    def answer(verbose: bool = False) -> Any:
        if verbose:
            return check(verbose=verbose)
        data = _read(path)
        entry = data.get(name)
        if isinstance(entry, dict) and entry.get("key") == key and entry.get("value") in (True, False, None):
            return entry["value"]
        value = check(verbose=False)
        if value in (True, False, None):
            data[name] = {"key": key, "value": value}
            _write(path, data)
        return value
    return answer


def changes() -> List[Change]:
    """``horovod.runner.launch``'s build checks answered from the cache (this process only; made by
    :func:`elastic_ext.launch.horovod_changes.install_launcher`)."""
    import horovod
    from horovod.runner import launch

    key = extensions_key(os.path.dirname(horovod.__file__))
    path = cache_path()
    return [(launch, name, cached(name, getattr(launch, name), key, path)) for name in CHECKS]

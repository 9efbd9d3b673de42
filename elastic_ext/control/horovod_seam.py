"""The one check of the Horovod that elastic_ext reshapes (its version, every attribute replaced or read), and
the record of every change made.

The launcher (:mod:`elastic_ext.launch.horovodrun`) overrides methods of
Horovod 0.28.1's elastic driver, registry, discovery and worker client in
its subclasses, replaces a few attributes of its rendezvous server and
command line, and reads their private fields; the worker entry
(:mod:`elastic_ext.worker.entry`) wraps ``HorovodBasics`` and Horovod's
notification service. Both halves of the seam make their changes through
:func:`make`, which records each original in :data:`REPLACED`. A Horovod of
another version, a build from master or a fork may have moved any of them,
which would change the launcher's behaviour silently, or break it in the
middle of a job. :func:`check_launcher` and :func:`check_worker` look once,
before anything is replaced, and raise one :class:`~elastic_ext.errors.ConfigError`
that names every difference: what was expected, what was found, and what to do.

The tables below are the whole surface: :data:`LAUNCHER` (the driver's
process) and :data:`WORKER` (a worker, before its script; under an elastic
``horovodrun`` also :data:`WORKER_ELASTIC`). Each row is ``(module,
attribute, how)``, ``how`` being ``"replaced"`` (the project sets it on
Horovod's class or module), ``"bound"`` (a module name through which
Horovod builds an object, set to the project's subclass), ``"overridden"``
(a method or class a subclass of the project's overrides or extends,
calling Horovod's), ``"read"`` (a
module or class attribute the project reads or calls) or
``"instance"`` (a field Horovod's class sets on its instances, ``self.NAME``
in the source of the class or a base; or a method of the class a Horovod
function builds, ``def NAME(`` in its source). The PyTorch extension's wait
(:mod:`elastic_ext.worker.torch_wait`) is left out: it is looked for once
the extension is loaded and left alone when it is missing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from elastic_ext.errors import ConfigError

EXPECTED_VERSION = "0.28.1"

Row = Tuple[str, str, str]

#: One change made by :func:`make`: ``(owner, name, value)``, ``owner`` a Horovod class, module or object.
Change = Tuple[Any, str, Any]

#: Every change made in this process: ``(owner, name) -> Horovod's original``.
REPLACED: Dict[Tuple[Any, str], Any] = {}


def make(changes: Iterable[Change]) -> None:
    """Makes ``changes``, recording each original in :data:`REPLACED` (the first one: a name changed twice
    keeps Horovod's). Called only by the two halves of the seam, :mod:`elastic_ext.launch.horovod_changes`
    and :mod:`elastic_ext.worker.horovod_changes`."""
    for owner, name, value in changes:
        REPLACED.setdefault((owner, name), getattr(owner, name))
        setattr(owner, name, value)


_DRIVER = "horovod.runner.elastic.driver"
_REGISTRY = "horovod.runner.elastic.registration"
_DISCOVERY = "horovod.runner.elastic.discovery"
_HTTP = "horovod.runner.http.http_server"
_BASICS = "horovod.common.basics"

#: What the launcher's process replaces or reads (driver_*.py, discovery_runs, noticed_hosts,
#: store, store_guard, worker_clients, worker_runs, build_check, ssh_keepalive, horovodrun).
LAUNCHER: Sequence[Row] = (
    ("horovod.runner.gloo_run", "ElasticDriver", "bound"),
    *((_DRIVER, f"ElasticDriver.{name}", "overridden") for name in (
        "_get_host_assignments", "_update_host_assignments", "get_slot_info", "_start_worker_process",
        "record_ready", "_handle_worker_exit", "__init__", "register_worker_server", "_discover_hosts")),
    *((_DRIVER, f"ElasticDriver.{name}", "read") for name in (
        "_notify_workers_host_changes", "has_rank_assignment", "world_size", "finished", "host_assignments",
        "get_coordinator_info", "get_worker_client")),
    *((_DRIVER, f"ElasticDriver.{name}", "instance") for name in (
        "_rendezvous", "_host_manager", "_worker_registry", "_worker_clients", "_min_num_proc", "_max_num_proc",
        "_shutdown", "_host_assignments", "_wait_hosts_cond", "_verbose")),
    (_DRIVER, "WorkerNotificationClient", "overridden"),  # its _wire, in the launcher's driver's clients
    (_DRIVER, "DISCOVER_HOSTS_FREQUENCY_SECS", "read"),
    (_DRIVER, "_epoch_time_s", "read"),  # the timestamp of a host notification, as Horovod's own tells
    (_REGISTRY, "WorkerStateRegistry.reset", "overridden"),
    (_REGISTRY, "WorkerStateRegistry._on_workers_recorded", "overridden"),
    *((_REGISTRY, f"WorkerStateRegistry.{name}", "read") for name in ("last_rendezvous", "get")),
    *((_REGISTRY, f"WorkerStateRegistry.{name}", "instance") for name in (
        "_driver", "_host_manager", "_lock", "_states", "_workers", "_barrier", "_rendezvous_id", "_size",
        "_action_event")),
    # held_ranks: the registry's barrier counts held rank requests (its reset builds it as Horovod's does)
    *((_REGISTRY, f"WorkerStateRegistry.{name}", "read") for name in ("_wait", "_action", "record_ready")),
    *((_REGISTRY, name, "read") for name in ("FAILURE", "READY", "SUCCESS")),
    (_DISCOVERY, "HostManager.update_available_hosts", "read"),
    (_DISCOVERY, "HostManager.blacklist", "replaced"),  # shadowed on the instance while a round is recorded
    (_DISCOVERY, "HostManager.current_hosts", "read"),
    (_DISCOVERY, "DiscoveredHosts.host_assignment_order", "read"),
    (_DISCOVERY, "DiscoveredHosts.count_available_slots", "read"),
    (_DISCOVERY, "HostManager._discovery", "instance"),
    (_DISCOVERY, "HostDiscoveryScript._execute_discovery_script", "overridden"),
    (_DISCOVERY, "HostDiscoveryScript._discovery_script", "instance"),
    (_DISCOVERY, "HostDiscoveryScript._default_slots", "instance"),
    (_DISCOVERY, "HostUpdateResult", "read"),
    (_HTTP, "KVStoreHandler._put_value", "replaced"),
    (_HTTP, "KVStoreHandler.do_PUT", "read"),
    (_HTTP, "RendezvousServer.start", "replaced"),
    (_HTTP, "RendezvousServer._httpd", "instance"),
    (_HTTP, "RendezvousHTTPServer.verify_request", "replaced"),
    (_HTTP, "RendezvousHTTPServer.request_queue_size", "replaced"),  # store_serving (inherited from socketserver)
    (_HTTP, "RendezvousHTTPServer.serve_forever", "replaced"),
    (_HTTP, "RendezvousHTTPServer.cache", "instance"),
    (_HTTP, "RendezvousHTTPServer.cache_lock", "instance"),
    ("horovod.runner.elastic.worker", "HostUpdateResult", "read"),
    ("horovod.runner.elastic.worker", "WorkerNotificationClient.notify_hosts_updated", "read"),
    # the handler class Horovod builds in a function: its worker registration, which store_guard calls
    ("horovod.runner.elastic.rendezvous", "create_rendezvous_handler._put_worker_addresses", "instance"),
    ("horovod.runner.common.util.network", "Wire._key", "instance"),
    ("horovod.runner.common.util.network", "BasicClient._send", "read"),
    ("horovod.runner.common.util.network", "BasicClient._wire", "instance"),
    ("horovod.runner.common.util.secret", "DIGEST_LENGTH", "read"),
    ("horovod.runner.common.util.secret", "check_digest", "read"),
    ("horovod.runner.common.util.safe_shell_exec", "execute", "replaced"),
    ("horovod.runner.common.util.hosts", "get_host_assignments", "read"),
    ("horovod.runner.common.util.hosts", "HostInfo", "read"),
    ("horovod.runner.launch", "gloo_built", "replaced"),
    ("horovod.runner.launch", "mpi_built", "replaced"),
    ("horovod.runner.launch", "parse_args", "replaced"),
    ("horovod.runner.launch", "run_commandline", "read"),
    ("horovod.runner.util.remote", "SSH_COMMAND_PREFIX", "replaced"),
)

#: What every worker entry wraps (newcomer, torch_wait).
WORKER: Sequence[Row] = (
    *((_BASICS, f"HorovodBasics.{name}", "replaced") for name in (
        "init", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")),
)

#: What a worker of an elastic ``horovodrun`` also changes (newcomer, notices).
WORKER_ELASTIC: Sequence[Row] = (
    ("horovod.common.process_sets", "global_process_set.ranks", "replaced"),
    ("horovod.runner.elastic.worker", "WorkerNotificationService._handle", "replaced"),
    ("horovod.runner.common.util.network", "AckResponse", "read"),
)


def _sets_on_instances(owner: object, name: str) -> bool:
    """True if the source of class ``owner`` or of a base assigns ``self.<name>``, or, for a function that
    builds a class (Horovod's ``create_rendezvous_handler``), its source defines method ``name``."""
    for klass in inspect.getmro(owner) if isinstance(owner, type) else (owner,):
        try:
            source = inspect.getsource(klass)  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue  # a builtin base (object), or no source installed
        if f"self.{name} =" in source or f"self.{name}=" in source or f"def {name}(" in source:
            return True
    return False


def missing(rows: Sequence[Row]) -> List[str]:
    """One line per row of ``rows`` that this Horovod lacks: what, where, and how the project uses it."""
    found = []
    for module_name, attribute, how in rows:
        where = f"{module_name}.{attribute} ({how})"
        try:
            target: object = importlib.import_module(module_name)
        except ImportError as exc:
            found.append(f"{where}: module {module_name} not importable ({exc})")
            continue
        parts = attribute.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if hasattr(target, part):
                target = getattr(target, part)
                continue
            if last and how == "instance" and callable(target) and _sets_on_instances(target, part):
                break
            held = ".".join([module_name, *parts[:depth]])
            found.append(f"{where}: expected, not found ({held} has no attribute {part!r})")
            break
    return found


def differences(rows: Sequence[Row], version: Optional[str] = None) -> List[str]:
    """Every difference from the Horovod this project was built against: its version, then ``rows``."""
    import horovod

    found = []
    version = getattr(horovod, "__version__", None) if version is None else version
    if version != EXPECTED_VERSION:
        found.append(f"Horovod version: expected {EXPECTED_VERSION}, found {version} "
                     f"({getattr(horovod, '__file__', '?')})")
    return found + missing(rows)


def _check(rows: Sequence[Row]) -> None:
    found = differences(rows)
    if found:
        raise ConfigError(
            f"this Horovod differs from the one elastic_ext's launcher changes (horovod {EXPECTED_VERSION}), in "
            f"{len(found)} place(s):\n  - " + "\n  - ".join(found)
            + f"\nInstall horovod=={EXPECTED_VERSION} (pip install horovod=={EXPECTED_VERSION}), or start the job "
              "with plain horovodrun, which elastic_ext's training side also supports without the launcher.")


#: The build patch (tools/horovod_patches/) with which an elastic job may fix both tuning values
#: (:func:`elastic_ext.launch.command_line.crashing_tuning`).
TUNING_FIX = "07-fixed-tuning-after-reset"


def build_patches() -> Tuple[str, ...]:
    """The names of the project's build patches the installed Horovod carries, () for one built without them.

    ``tools/setup.sh`` records them in ``horovod/elastic_ext_patches.py`` when it builds Horovod from its
    sdist (the current stack); a Horovod from elsewhere has no such module.

    Raises:
        ConfigError: the module is there but its ``PATCHES`` is not a tuple of names.
    """
    try:
        module = importlib.import_module("horovod.elastic_ext_patches")
    except ImportError:
        return ()
    patches = getattr(module, "PATCHES", None)
    if not isinstance(patches, tuple) or not all(isinstance(name, str) for name in patches):
        raise ConfigError(f"{getattr(module, '__file__', 'horovod.elastic_ext_patches')}: PATCHES is {patches!r}, "
                          "expected a tuple of patch names; rebuild Horovod with tools/setup.sh")
    return patches


def check_launcher() -> None:
    """Raises :class:`ConfigError` naming every difference of the driver's (and its workers') Horovod surface."""
    _check((*LAUNCHER, *WORKER, *WORKER_ELASTIC))


def check_worker(elastic: bool) -> None:
    """Raises :class:`ConfigError` naming every difference of what a worker's entry wraps (``elastic``: of an
    elastic ``horovodrun``, whose worker also changes Horovod's process set and notification service).

    Nothing to check where Horovod is not installed: the entry wraps nothing then, and the script's own
    ``import horovod`` says what is missing.
    """
    if importlib.util.find_spec("horovod") is None:
        return
    _check((*WORKER, *WORKER_ELASTIC) if elastic else WORKER)


__all__ = ["REPLACED", "Change", "make", "EXPECTED_VERSION", "LAUNCHER", "TUNING_FIX", "WORKER", "WORKER_ELASTIC",
           "build_patches", "check_launcher", "check_worker", "differences", "missing"]

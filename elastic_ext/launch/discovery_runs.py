"""The driver's runs of the discovery script: outside its host lock, as a plain child process, its hosts checked.

Horovod's driver runs ``--host-discovery-script`` once a second, and does
three things there that the launcher changes:

1. **The script runs while the driver holds its host lock**, the lock that
   forming a round takes too (``wait_for_available_slots``). A failure
   whose round forms while the script runs waits for the script's end:
   here 0.3 s and more, in about a third of the failures. Under the
   launcher the script runs first, with no lock held, and only its answer
   is applied under the lock (:func:`discover_hosts`, the launcher's
   driver's ``_discover_hosts``, :mod:`elastic_ext.launch.driver`;
   :class:`Prefetched` hands the answer to Horovod's ``HostManager``
   unchanged, so blacklists, cooldowns and the notices' filter act on it as
   before).
2. **Each run starts a fresh Python interpreter as a middleman**
   (``safe_shell_exec``, multiprocessing's spawn), which then starts the
   script: about 0.3 s of CPU a second on the driver's host, beside the
   workers, before the script's own. Under the launcher the script is a
   plain child of the driver (:func:`run_script`, in the discovery the
   driver builds from Horovod's, :func:`script_discovery`): the same shell
   command, environment, exit-status rule and parsing as Horovod's.

3. **Host names are checked before Horovod sees them**, whichever
   discovery listed them (a user's own script included): Horovod puts
   them unquoted into the shell command lines that start the workers
   (``HOROVOD_HOSTNAME=host``, ``ssh host``), so a line ``x$(cmd):1`` would
   run ``cmd`` on the launcher's host. :class:`Prefetched` refuses, with an
   error naming it, every host that the project's own discovery scripts
   would not emit (:func:`elastic_ext.discovery.hosts.host_error`: a host
   name or an IPv4 address, no shell metacharacters, no leading ``-``).

4. **The script is bounded**: Horovod waits for it without a limit, and
   leaves it running when the driver ends. Under the launcher a script
   still running after :data:`SCRIPT_TIMEOUT_S` is killed with its process
   group and the run fails (Horovod's error rule below), and the workers'
   guard (:func:`elastic_ext.launch.worker_runs.start_guard`) kills the
   group when the driver exits or dies first. The script's shell waits
   (:data:`GATED`) until the guard knows its group: a driver that dies as
   the script starts leaves nothing running.

Everything else is Horovod's: the period, the error rule (the first
discovery's failure ends the job, later ones are logged and retried), the
notification of the workers.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import threading
from typing import Any, Dict, Optional

from elastic_ext.discovery.hosts import host_error
from elastic_ext.launch.worker_runs import arm_guard, start_guard, stop_guard

logger = logging.getLogger(__name__)

_refused: set = set()       # hosts refused so far: each is logged once, not at every discovery run
REFUSED_LOGGED = 1024
# The project's own scripts end within their --timeout-s (5 s by default) and half a second; Horovod asks every
# second, so a script still running after a minute is hung, not slow, and a later run may answer.
SCRIPT_TIMEOUT_S = 60.0
# The script's shell waits for one line before it runs the script (an EOF first: the driver is gone, run nothing).
GATED = 'IFS= read -r go || exit 125; exec /bin/sh -c "$1" </dev/null'


def valid_hosts(found: Dict[str, int]) -> Dict[str, int]:
    """``found`` without the hosts whose names must not reach Horovod (change 3), each refused with an error."""
    kept = {}
    for host, slots in found.items():
        reason = host_error(host) if isinstance(host, str) else f"host {host!r} is not a string"
        if reason is None:
            kept[host] = slots
        elif host not in _refused and len(_refused) < REFUSED_LOGGED:
            _refused.add(host)
            logger.error("elastic_ext: discovery listed a host the driver refuses: %s; no worker starts there "
                         "(a host name reaches the shell command lines that start workers)", reason)
    return kept


def run_script(self: Any) -> str:
    """``HostDiscoveryScript._execute_discovery_script`` under the launcher: the script's output.

    Raises:
        RuntimeError: the script exited non-zero (Horovod's message), or ran past :data:`SCRIPT_TIMEOUT_S`.
    """
    guard = start_guard()  # ends the group if the driver exits or dies while the script runs
    try:
        # Its own group (a timeout kills what the script started too), held at GATED until the guard knows
        # the group: a driver that dies in between leaves nothing running unguarded.
        shell = subprocess.Popen(["/bin/sh", "-c", GATED, "elastic_ext-discovery", self._discovery_script],
                                 stdout=subprocess.PIPE, stdin=subprocess.PIPE, start_new_session=True)
    except BaseException:
        stop_guard(guard)
        raise
    arm_guard(guard, shell.pid)
    try:
        assert shell.stdin is not None
        shell.stdin.write(b"go\n")
        shell.stdin.close()
        shell.stdin = None  # (communicate would flush it)
        out, _ = shell.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the whole group ended in between: nothing left to kill
        shell.communicate()
        raise RuntimeError(f"Discovery script {self._discovery_script} did not finish within {SCRIPT_TIMEOUT_S:g}s: "
                           "killed") from None
    finally:
        stop_guard(guard)
    if shell.returncode != 0:
        code = shell.returncode if shell.returncode >= 0 else 128 - shell.returncode  # a shell's status
        raise RuntimeError(f"Failed to execute discovery script: {self._discovery_script}. Exit code: {code}")
    return out.decode("utf-8", errors="replace")


class Prefetched:
    """A discovery whose next answer may be fetched before the host lock is taken.

    :meth:`fetch` runs the wrapped discovery (no lock held); the next
    :meth:`find_available_hosts_and_slots` (``HostManager``'s, under the
    lock) returns that answer once. Without a fetched answer it runs the
    wrapped discovery itself, as Horovod would. Either answer holds only
    valid host names (:func:`valid_hosts`).
    """

    def __init__(self, discovery: Any) -> None:
        self.discovery = discovery
        self._found: Optional[Dict[str, int]] = None
        self._lock = threading.Lock()

    def fetch(self) -> None:
        found = valid_hosts(self.discovery.find_available_hosts_and_slots())
        with self._lock:
            self._found = found

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        with self._lock:
            found, self._found = self._found, None
        return valid_hosts(self.discovery.find_available_hosts_and_slots()) if found is None else found


def _prefetched(manager: Any) -> Prefetched:
    """The :class:`Prefetched` at the bottom of ``manager``'s discovery, wrapping it there first if needed."""
    holder, discovery = manager, manager._discovery
    attribute = "_discovery"
    while not isinstance(discovery, Prefetched) and hasattr(discovery, "discovery"):
        holder, discovery, attribute = discovery, discovery.discovery, "discovery"  # a filter (notices)
    if not isinstance(discovery, Prefetched):
        discovery = Prefetched(discovery)
        setattr(holder, attribute, discovery)
    return discovery


def discover_hosts(self: Any) -> None:
    """``ElasticDriver._discover_hosts`` under the launcher: the script outside the host lock."""
    from horovod.runner.elastic.discovery import HostUpdateResult
    from horovod.runner.elastic.driver import DISCOVER_HOSTS_FREQUENCY_SECS

    first_update = True
    while not self._shutdown.is_set():
        try:
            _prefetched(self._host_manager).fetch()
            with self._wait_hosts_cond:
                update_res = self._host_manager.update_available_hosts()
                if update_res != HostUpdateResult.no_update:
                    self._notify_workers_host_changes(self._host_manager.current_hosts, update_res)
                    self._wait_hosts_cond.notify_all()
        except BaseException as exc:
            if first_update:  # a misconfiguration: the job ends now, as under Horovod
                self._shutdown.set()
                with self._wait_hosts_cond:
                    self._wait_hosts_cond.notify_all()
                raise
            logger.warning(str(exc))  # transient: the next period tries again
        first_update = False
        self._shutdown.wait(DISCOVER_HOSTS_FREQUENCY_SECS)


@functools.lru_cache(maxsize=None)
def _script_class() -> type:
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    class Script(HostDiscoveryScript):  # type: ignore[misc, valid-type]
        """Horovod's discovery by script, the script run by :func:`run_script`."""
        _execute_discovery_script = run_script

    return Script


def script_discovery(discovery: Any) -> Any:
    """``discovery`` as the launcher's driver runs it: Horovod's ``HostDiscoveryScript`` becomes one whose
    script runs through :func:`run_script` (same script, same default slots, same parsing); any other
    discovery is returned as it is."""
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    if type(discovery) is not HostDiscoveryScript:
        return discovery
    return _script_class()(discovery._discovery_script, discovery._default_slots)

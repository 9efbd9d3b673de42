"""``elastic-horovodrun ARGS`` (``python -m elastic_ext.launch.horovodrun ARGS``): the way to launch a job.

The arguments are ``horovodrun``'s. Each worker's Python is started through
:mod:`elastic_ext.launch.worker`, which does in the worker what must happen
before the user's code (restart in place, the newcomer's side of an early
start, Gloo's first timeout, SIGTERM as "leave") and then runs the script:
``python train.py`` becomes ``python -m elastic_ext.launch.worker train.py``
(a command that is not a Python script or module runs as given, without
those). Outside elastic mode the driver is plain ``horovodrun``'s. In
elastic mode, Horovod's driver (Horovod 0.28.1's ``ElasticDriver``, run in
this process) changes in three ways:

1. **A host is blacklisted only when it lost all its workers of the round.**
   Horovod blacklists the host of every failed worker, which also ends that
   host's other workers ("has been removed from elastic job") and, when two
   hosts each lose a worker in one round, leaves no host ("blacklisted
   slots count == N", "No hosts from previous set remaining"): the job ends
   although most of its workers are alive. A worker killed on a host whose
   other workers recorded themselves ready in that round is a process
   failure; the driver starts a new worker in its slot. A host whose every
   worker of the round failed (a lost machine) is blacklisted as before,
   and a single-slot host with a failed worker too. A slot whose worker
   fails at every start (a broken GPU) then costs the job a round each
   time, where Horovod would have set its host aside for the blacklist
   cooldown: ``--reset-limit`` bounds that.
2. **Workers learn that their round is lost** (:mod:`elastic_ext.launch.round_watch`):
   the rendezvous server's store holds the current round's number and
   slots, and a key per round in which a member failed, so workers waiting
   in ``hvd.init()`` for a dead peer need not wait for the rendezvous
   timeout, and a keeper does not restart a worker whose slot left the job
   (with ``ELASTIC_EXT_RESTART_IN_PLACE=1``).
3. **The exit of a replaced worker is not charged to its successor.**
   Horovod names a worker by its slot (host, local rank) and records every
   exit under that name. A worker on a blacklisted host is ended by its
   driver in up to 10 s (SIGTERM, 5 s, then SIGKILL), and an elastic_ext
   worker leaves at its next commit on SIGTERM, so it can take that
   long. When the blacklist cooldown is shorter, the host is back and a new
   worker runs in the same slot by then: Horovod records the old worker's
   exit (137) as the new worker's failure in the current round, which
   later ends the job early, terminating whoever is still finishing
   ("key exists and new state SUCCESS not FAILURE"). The driver now
   ignores the exit of a worker that is no longer its slot's newest.

The workers restart in place (:mod:`elastic_ext.launch.keeper`) unless
``ELASTIC_EXT_RESTART_IN_PLACE`` says otherwise, when the job has durable
checkpoints (``ELASTIC_EXT_CHECKPOINT_DIR``): a restarted worker holds no
commit. Everything else is Horovod's, unchanged: ``--reset-limit``, the blacklist
cooldown, discovery.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, List, MutableMapping, Optional

from elastic_ext.config import ENV_CHECKPOINT_DIR, ENV_LAUNCHER, ENV_RESTART_IN_PLACE, restart_in_place
from elastic_ext.launch import ssh_keepalive
from elastic_ext.launch.round_watch import ASSIGNED, CURRENT, SCOPE, failed_key

_originals: dict = {}  # what install() replaced: (class, name) -> the original


def _store(driver: Any, key: str, value: bytes) -> None:
    """Writes into the driver's rendezvous server's key-value store (the scope workers read)."""
    server = getattr(getattr(driver, "_rendezvous", None), "_httpd", None)
    if server is None:
        return
    with server.cache_lock:
        server.cache.setdefault(SCOPE, {})[key] = value


def install() -> None:
    """Changes Horovod's elastic driver as the module docstring says; idempotent."""
    if _originals:
        return
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import FAILURE, READY, WorkerStateRegistry

    original_reset = WorkerStateRegistry.reset
    original_recorded = WorkerStateRegistry._on_workers_recorded
    original_exit = ElasticDriver._handle_worker_exit
    original_update = ElasticDriver._update_host_assignments
    original_start = ElasticDriver._start_worker_process

    def reset(self: Any, size: int) -> None:
        original_reset(self, size)  # after the new round's assignments, which cleared the store
        driver = self._driver
        slots = [f"{host}:{slot.local_rank}" for host, host_slots in driver.host_assignments.items()
                 for slot in host_slots]
        _store(driver, ASSIGNED, ",".join(slots).encode("utf-8"))
        _store(driver, CURRENT, str(self.last_rendezvous()).encode("ascii"))

    def on_workers_recorded(self: Any) -> None:
        manager = self._host_manager
        ready_hosts = {host for host, _ in self.get(READY)}
        blacklist = manager.blacklist
        # The failed slots of hosts that stay: the next round starts a new worker in each.
        self._driver.elastic_ext_restart = {(host, slot) for host, slot in self.get(FAILURE) if host in ready_hosts}

        def blacklist_lost_hosts(host: str) -> None:
            if host in ready_hosts:
                logging.warning("elastic_ext: not blacklisting %s: another of its workers is ready (a worker "
                                "failed, not the host)", host)
                return
            blacklist(host)

        manager.blacklist = blacklist_lost_hosts
        try:
            original_recorded(self)
        finally:
            del manager.blacklist  # the class's method again

    def update_host_assignments(self: Any, current_hosts: Any) -> Any:
        restart = getattr(self, "elastic_ext_restart", set())
        self.elastic_ext_restart = set()
        if restart:  # Horovod starts workers only in slots it does not count as filled
            self._host_assignments = {host: [slot for slot in slots if (host, slot.local_rank) not in restart]
                                      for host, slots in self._host_assignments.items()}
        return original_update(self, current_hosts)

    def start_worker_process(self: Any, slot_info: Any) -> None:
        newest = self.__dict__.setdefault("elastic_ext_newest", {})
        newest[(slot_info.hostname, slot_info.local_rank)] = slot_info
        original_start(self, slot_info)

    def handle_worker_exit(self: Any, slot_info: Any, exit_code: int, timestamp: Any) -> None:
        newest = getattr(self, "elastic_ext_newest", {}).get((slot_info.hostname, slot_info.local_rank))
        if newest is not None and newest is not slot_info:
            logging.warning("elastic_ext: ignoring exit code %d of a replaced worker of %s[%d]: a newer worker "
                            "runs in its slot", exit_code, slot_info.hostname, slot_info.local_rank)
            return
        if exit_code != 0 and not self.finished() and self.has_rank_assignment(slot_info.hostname,
                                                                                slot_info.local_rank):
            who = f"{slot_info.hostname}[{slot_info.local_rank}]".encode()
            _store(self, failed_key(self._worker_registry.last_rendezvous()), who)
        original_exit(self, slot_info, exit_code, timestamp)

    for cls, name, replacement in ((WorkerStateRegistry, "reset", reset),
                                   (WorkerStateRegistry, "_on_workers_recorded", on_workers_recorded),
                                   (ElasticDriver, "_update_host_assignments", update_host_assignments),
                                   (ElasticDriver, "_start_worker_process", start_worker_process),
                                   (ElasticDriver, "_handle_worker_exit", handle_worker_exit)):
        _originals[(cls, name)] = getattr(cls, name)
        setattr(cls, name, replacement)


def uninstall() -> None:
    """Gives Horovod's driver its own behaviour back (for tests that run both in one process)."""
    for (cls, name), original in _originals.items():
        setattr(cls, name, original)
    _originals.clear()


def restart_in_place_by_default(environ: MutableMapping[str, str]) -> bool:
    """Turns restart in place on for the workers when the job has durable checkpoints and the user said nothing.

    A restarted worker holds no commit, so without a checkpoint directory it
    cannot help. Returns whether the workers restart in place.
    """
    if ENV_RESTART_IN_PLACE not in environ and environ.get(ENV_CHECKPOINT_DIR):
        environ[ENV_RESTART_IN_PLACE] = "1"
    return restart_in_place(environ)


WORKER_MODULE = "elastic_ext.launch.worker"
# Interpreter options that may stand before the script: alone, or with a value (-W, -X).
_FLAGS = {"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-d", "-v"}
_FLAGS_WITH_VALUE = {"-W", "-X"}


def worker_command(command: List[str]) -> List[str]:
    """``command`` with its Python started through :mod:`elastic_ext.launch.worker`.

    ``python [flags] SCRIPT ...`` and ``python [flags] -m MODULE ...`` gain
    ``-m elastic_ext.launch.worker`` after the flags; anything else (a shell
    script, ``python -c``, a command already through the worker) is returned as it is.
    """
    if not command or not os.path.basename(command[0]).startswith("python"):
        return list(command)
    i = 1
    while i < len(command) and (command[i] in _FLAGS or command[i] in _FLAGS_WITH_VALUE):
        i += 2 if command[i] in _FLAGS_WITH_VALUE else 1
    rest = command[i:]
    if not rest or rest[0] == "-c" or rest[:2] == ["-m", WORKER_MODULE] or (rest[0].startswith("-") and rest[0] != "-m"):
        return list(command)
    return [*command[:i], "-m", WORKER_MODULE, *rest]


def _through_the_worker_entry() -> None:
    """Makes Horovod's command line start every worker through :func:`worker_command`."""
    from horovod.runner import launch

    parse_args = launch.parse_args

    def parse_and_rewrite() -> Any:
        args = parse_args()
        command = worker_command(args.command or [])
        if command != (args.command or []):
            os.environ[ENV_LAUNCHER] = "1"  # the workers' entry module runs: early start is possible
        elif command:  # (no command at all: --check-build, --version)
            logging.warning("elastic_ext: %r is not 'python SCRIPT' or 'python -m MODULE': the workers start as "
                            "given, without what the launcher does before user code (restart in place, early start "
                            "of newcomers, SIGTERM as a leave while the job re-forms)", args.command)
        args.command = command
        return args

    launch.parse_args = parse_and_rewrite


def main(argv: Optional[List[str]] = None) -> None:
    """The console script ``elastic-horovodrun``: ``horovodrun``'s arguments, the launcher's behaviour."""
    restart_in_place_by_default(os.environ)
    install()
    ssh_keepalive.install()
    _through_the_worker_entry()
    from horovod.runner.launch import run_commandline
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()


if __name__ == "__main__":
    main()

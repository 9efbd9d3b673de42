"""A warm spare per host: a new worker's entry hands its slot to a process that already imported PyTorch.

A new worker (the failed slot's, started by the survivors' early start)
spends most of its start importing PyTorch: 1.0 s of the 1.5 s that
``torch``, ``horovod.torch`` and ``elastic_ext`` take on an idle core of
this project's test machine, more on a host whose cores train. Meanwhile
its job trains on one worker fewer.

Under ``elastic-horovodrun`` each worker's entry
(:mod:`elastic_ext.launch.worker`) whose script imports PyTorch keeps one
*spare* per host and job: a detached process (``python -m
elastic_ext.launch.worker --spare SCRIPT``) that imported PyTorch
(:func:`preload`) and waits on a Unix socket in
the abstract namespace, named after the job's rendezvous server, the
interpreter and the script (:func:`address`). The next entry on that host
connects to it and hands over its slot (:func:`hand_off`): its arguments,
environment, working directory and standard streams (the descriptors
themselves, so the driver's output prefixes and pipes stay as they are).
The spare forks the worker there, which runs as the entry would have
(the entry module's ``run``: keeper, newcomer, script). The
entry stays the process Horovod's driver started and watches:

- the spare sends it the worker's end, and the entry ends the same way (its
  exit code, or the same signal), so the driver records what it would have;
- the entry passes SIGTERM, SIGINT, SIGHUP and SIGUSR1 on to the worker's
  process group (a leave, a preemption notice), as the driver's signals
  reach a worker's processes;
- when the entry dies (the driver kills it, or the driver dies and its
  guard kills the entry's process group), the spare sees its socket close,
  kills the worker's process group and exits.

The spare that took a slot starts the next spare at once, so the slot after
it finds one too. An entry that found no spare starts one (the job's first
workers); of several started at once only the first to bind the name stays.
A spare exits when the job's rendezvous server refuses a connection or
misses :data:`MISSES_BEFORE_GONE` reads in a row (one every
:data:`ALIVE_POLL_S`), and never holds more than PyTorch's import (no
model, no CUDA context, no thread but the interpreter's own).

Nothing here runs outside a worker of ``elastic-horovodrun`` (the
launcher's variable and Horovod's rendezvous address are in its
environment), off Linux, or for a script that does not import PyTorch.
"""

from __future__ import annotations

import array
import ast
import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from elastic_ext.launch import round_watch
from elastic_ext.config import ENV_RESTARTED_IN_PLACE, elastic_horovodrun, horovod_rendezvous, launched
from elastic_ext.errors import ConfigError

ENTRY_MODULE = "elastic_ext.launch.worker"  # a spare is this module's process: python -m ENTRY_MODULE --spare SCRIPT
SPARE_FLAG = "--spare"
NEXT_FLAG = "--next"  # a spare started by the one that took a slot (see serve)
ALIVE_POLL_S = 1.0   # how often a waiting spare checks that its job's rendezvous server still answers
MISSES_BEFORE_GONE = 3  # reads in a row the server does not answer before a spare takes its job for gone
CONNECT_TIMEOUT_S = 2.0  # an entry's wait for a spare to take its slot, once connected
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
MAX_MESSAGE = 1 << 20  # the hand-over's JSON (arguments, environment, working directory)
STREAMS = 3            # stdin, stdout, stderr
PR_SET_NAME = 15
# An entry that handed its slot over names itself RELAY_NAME + the worker's pid (its process group), so
# that tools find the worker from the process the driver started (elastic_ext.testing.launch.script_process).
RELAY_NAME = "relay:"
PRELOADED = "torch"  # what a spare imports, for a script that imports it

# In a worker the spare forked: how its entry handed the slot over (the fields of the from_spare event).
served: Optional[Dict[str, Any]] = None


def imports_torch(path: str) -> bool:
    """True when the Python source at ``path`` imports PyTorch or a module under it or named after it
    (``torch.nn``, ``horovod.torch``, ``elastic_ext.torch``); False for a file that cannot be read or parsed
    (the script then fails on its own, with its own error)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return any(PRELOADED in name.split(".") for name in names)


def script_path(target: str, module: bool) -> Optional[str]:
    """The source file of the worker's script, or of its ``-m`` module when that is a top-level module
    (finding a submodule would import its package in the entry); None when there is none."""
    if not module:
        return target
    if "." in target:
        return None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def preload() -> bool:
    """Imports :data:`PRELOADED` in this process (the spare's); False where it is not installed."""
    try:
        importlib.import_module(PRELOADED)
    except ImportError:
        return False  # the worker's own import raises it, where the user sees it
    return True


def address(script: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The spare's socket name for this job, interpreter and script; None where no spare serves.

    None outside a worker of ``elastic-horovodrun``, off Linux, in a process
    a script started (it inherited the keeper's variable), without a script
    file, or for one that does not import PyTorch.
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or not elastic_horovodrun(env) or not launched(env):
        return None
    if ENV_RESTARTED_IN_PLACE in env or script is None:
        return None
    try:
        rendezvous = horovod_rendezvous(env)
    except ConfigError:
        return None  # not a port: Horovod's own start reports it
    if rendezvous is None or not imports_torch(script):
        return None
    key = "\n".join([str(os.getuid()), f"{rendezvous[0]}:{rendezvous[1]}", sys.executable,
                     os.path.realpath(script)])
    return "\0elastic_ext-spare-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def hand_off(name: str, argv: List[str]) -> Optional[int]:
    """In a new worker's entry: gives its slot to the spare at ``name``, waits for the worker's end.

    Returns the worker's end as ``os.waitpid`` gives it, or None when no
    spare took the slot (none is listening, or it went away before it
    took it): the entry then starts the worker itself.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(name)
        message = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                              "started": _process_started()}).encode()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        payload = len(message).to_bytes(4, "little") + message
        fds = array.array("i", range(STREAMS))
        sent = sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        sock.sendall(payload[sent:])  # a stream socket may take a large environment in parts
        taken = _read_line(sock)
    except OSError:
        sock.close()
        return None
    if not taken.startswith("taken "):
        sock.close()
        return None
    group = int(taken.split()[1])
    sock.settimeout(None)
    _name(f"{RELAY_NAME}{group}")
    previous = {sig: signal.signal(sig, lambda sig, _frame: _signal_group(group, sig)) for sig in FORWARDED}
    try:
        try:
            ended = _read_line(sock)
        except OSError:
            ended = ""
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if ended.startswith("ended "):
        return int(ended.split()[1])
    return int(signal.SIGKILL)  # the spare died without a word: as a worker killed outright


def _process_started() -> Optional[float]:
    """When this process started (Unix time, to a clock tick), from /proc; None where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _name(name: str) -> None:
    """Sets this process's name (``comm``: what ``top`` and ``ps -o comm`` show, 15 bytes at most)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def relayed_worker(name: str) -> Optional[int]:
    """The pid of the worker an entry relays for, from the entry's process name; None for any other process."""
    if not name.startswith(RELAY_NAME):
        return None
    try:
        return int(name[len(RELAY_NAME):])
    except ValueError:
        return None


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except OSError:
        pass  # the worker ended meanwhile: its end is on its way


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(64)
        if not chunk:
            return ""
        data += chunk
        if len(data) > 64:
            return ""
    return data.decode("ascii", "replace").strip()


def start(script: str, first: bool = True) -> bool:
    """Starts a spare for ``script`` on this host, detached; False if it could not start.

    Detached twice (a session of its own, then its starter exits): no
    worker's process tree holds it, so the driver's end of a worker, or its
    guard's, never reaches it. It exits at once when another spare already
    holds the name. ``first``: see :func:`serve`.
    """
    argv = [sys.executable, "-m", ENTRY_MODULE, SPARE_FLAG, *([] if first else [NEXT_FLAG]), script]
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for target in range(STREAMS):
                    os.dup2(null, target)
                os.closerange(STREAMS, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
                os.execv(sys.executable, argv)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return True


class _Job:
    """Whether the spare's job is still there: its rendezvous server refused a connection (the driver is
    gone), or did not answer :data:`MISSES_BEFORE_GONE` reads in a row (a busy driver misses one)."""

    def __init__(self) -> None:
        self.misses = 0
        self.gone = False

    def current_round(self) -> Optional[bytes]:
        """The driver's current round number as stored (None: not there, or not read this time)."""
        try:
            value = round_watch.read(round_watch.CURRENT, os.environ)
        except OSError as exc:
            self.misses += 1
            refused = isinstance(getattr(exc, "reason", exc), ConnectionRefusedError)  # urllib wraps it
            self.gone = refused or self.misses >= MISSES_BEFORE_GONE
            return None
        self.misses = 0
        return value


def serve(script: str, first: bool, run: Callable[[List[str]], None]) -> int:
    """The spare's life (``python -m elastic_ext.launch.worker --spare [--next] SCRIPT``): wait, take one slot,
    relay its end. ``run``: what the worker does with its entry's arguments (the entry's own way to run them).

    ``first``: started by an entry that found none (the job's first
    workers), it imports PyTorch at once. Otherwise (started by the spare
    that took the last slot) it waits until the driver's round changed, so
    that its import does not take CPU from the worker that just took that
    slot while it starts (it joins in a new round).
    """
    from elastic_ext.launch import torch_pages

    name = address(script)
    if name is None:
        return 2
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)  # not listening yet: an entry that connects now starts its worker itself
    except OSError:
        return 0  # another spare holds the name
    job = _Job()
    started_in = job.current_round()
    while not first and not job.gone:
        time.sleep(ALIVE_POLL_S)
        current = job.current_round()
        if current is not None and current != started_in:
            break
    if job.gone:
        return 0
    torch_pages.install()  # before PyTorch's first allocation, as the worker's entry does
    preload()
    listener.listen(1)
    listener.settimeout(ALIVE_POLL_S)
    while True:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            job.current_round()
            if job.gone:
                return 0
            continue
        taken = _take(conn) if _same_user(conn) else None
        if taken is None:
            conn.close()
            continue
        listener.close()  # the name is free for the next spare, which this one starts now
        start(script, first=False)
        return _relay(conn, *taken, run)


def _credentials(conn: socket.socket) -> Tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


def _same_user(conn: socket.socket) -> bool:
    """True when the process at the other end runs as this user (the abstract name is open to every user)."""
    return _credentials(conn)[1] == os.getuid()


def _peer_pid(conn: socket.socket) -> int:
    return _credentials(conn)[0]


def _take(conn: socket.socket) -> Optional[tuple]:
    """Reads an entry's hand-over: (its message, its stream descriptors); None for a broken one."""
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        size_bytes, fds = _recv_fds(conn, 4)
        if len(size_bytes) != 4 or len(fds) != STREAMS:
            for fd in fds:
                os.close(fd)
            return None
        size = int.from_bytes(size_bytes, "little")
        if size > MAX_MESSAGE:
            raise OSError(f"a hand-over of {size} bytes")
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise OSError("the entry went away")
            data += chunk
        message = json.loads(data)
    except (OSError, ValueError):
        return None
    return message, fds


def _recv_fds(conn: socket.socket, size: int) -> tuple:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(size, socket.CMSG_SPACE(STREAMS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _relay(conn: socket.socket, message: Dict[str, Any], fds: List[int], run: Callable[[List[str]], None]) -> int:
    """Forks the worker with the entry's streams and environment, tells the entry its end, then exits."""
    global served
    from elastic_ext.launch import keeper

    spare = os.getpid()
    conn_peer = _peer_pid(conn)
    pid = os.fork()
    if pid == 0:
        # The worker: from here on it is the process the entry would have been; its end (an exception
        # included) is the interpreter's, as for a script Python runs.
        os.setpgid(0, 0)
        keeper.die_with(spare)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # When the worker's keeper ends, it tells the entry first: the entry ends before this process has
        # unmapped PyTorch (tens of milliseconds the survivors' next round would wait for).
        keeper.on_end = lambda status: _tell_end(conn, status)
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
        started = message.get("started")
        served = {"entry_pid": conn_peer, "handed_over_s": None if started is None else time.time() - started}
        run(message["argv"])
        raise SystemExit(0)
    try:
        os.setpgid(pid, pid)  # also here: the entry may signal the group before the child set it
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    conn.sendall(f"taken {pid}\n".encode())
    gone = threading.Event()

    def watch_entry() -> None:
        conn.settimeout(None)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        gone.set()
        try:
            os.killpg(pid, signal.SIGKILL)  # the entry died: so does its worker, as under a shell's guard
        except OSError:
            pass

    threading.Thread(target=watch_entry, name="elastic_ext-spare-entry", daemon=True).start()
    _, status = os.waitpid(pid, 0)
    if not gone.is_set():
        _tell_end(conn, status)
    return 0


def _tell_end(conn: socket.socket, status: int) -> None:
    """Sends the worker's end (as ``os.waitpid`` gives it) to its entry; the first one it reads counts."""
    try:
        conn.sendall(f"ended {status}\n".encode())
    except OSError:
        pass  # the entry is gone already


__all__ = ["ALIVE_POLL_S", "NEXT_FLAG", "RELAY_NAME", "SPARE_FLAG", "address", "hand_off", "relayed_worker", "start",
           "serve"]

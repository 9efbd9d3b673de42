"""SIGTERM means "leave at the next commit", from the first moment a worker can honour it.

A worker told to go (preemption, ``scancel``, the driver ending the job)
keeps training to its next commit, where every rank learns of it through
the commit's collective; the job then resizes without a rollback and the
leaver exits with :data:`~elastic_ext.exit_codes.LEAVE`.

The handlers of this module and of :mod:`elastic_ext.worker.notices` do no
more than a C signal handler could (a :class:`Relay`): Python runs a handler
between two bytecodes of the main thread, which may hold ``threading``'s
locks just then (inside ``Thread.start``, an ``Event``'s condition), so a
handler that logged, set an ``Event`` or started a thread could deadlock
the process. A thread started at install time does that work instead.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional

from elastic_ext.config import ElasticConfig, elastic_horovodrun
from elastic_ext.errors import ConfigError
from elastic_ext.exit_codes import LEAVE
from elastic_ext.liveness import LIVENESS, Liveness

logger = logging.getLogger(__name__)



class Relay:
    """A signal handler's only work, :meth:`ring` (one ``write(2)`` to a pipe, no lock), and the thread,
    started here (at install, never in a handler), that runs ``action`` for the rings it reads."""

    def __init__(self, action: Callable[[], None], name: str) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe must not block the main thread inside its handler
        self._action = action
        self.dropped = 0  # rings not written: the pipe was full (requests already pending) or closed
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def ring(self) -> None:
        """In a signal handler: asks the thread to run the action (rings pending together run it once)."""
        try:
            os.write(self._write, b"!")
        except OSError:  # full: the pending rings run the action anyway; closed: restored, nobody to ask
            self.dropped += 1  # no logging here: that is what the handler must not do

    def close(self) -> None:
        """Ends the thread once it has read what is pending (after the handler was replaced)."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1

    def _run(self) -> None:
        while True:
            try:
                rings = os.read(self._read, 4096)
            except OSError as exc:
                logger.error("elastic_ext: a signal relay cannot read its pipe (%s): its signal does nothing now", exc)
                return
            if not rings:
                os.close(self._read)
                return
            try:
                self._action()
            except Exception:  # noqa: BLE001 - the next signal must still be acted on
                logger.exception("elastic_ext: acting on a signal failed")


def install_sigterm(config: ElasticConfig, liveness: Optional[Liveness] = None):
    """Makes SIGTERM mean "leave at the next commit"; a second SIGTERM ends the process at once.

    Wherever the first one lands: in a step, in the sync, or while Horovod
    re-initialises. Dying there was worse for the job than staying: a
    worker that dies while its round of Horovod's rendezvous is forming
    leaves the round's other members waiting for it until the rendezvous
    timeout, and then they all fail, which ends the job ("failure count ==
    N", seen in the soak). A leave at the next commit is a resize without a
    rollback. While the main thread is inside Horovod's native
    re-initialisation the handler runs when it returns. ``term_grace_s``
    bounds the stay: after it the process exits (:data:`~elastic_ext.exit_codes.LEAVE`) without
    a commit. Only possible from the main thread; elsewhere this is a
    no-op. Returns the previous handler (to restore with
    :func:`restore_sigterm`), or None.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    live = liveness or LIVENESS
    asked: list = []  # by the handler; list.append takes no lock that the interrupted main thread might hold

    def leave() -> None:  # in the relay's thread
        if live.leaving():
            return  # already asked (a preemption notice): its deadline stands
        live.ask_to_leave(config.term_grace_s)
        logger.warning("SIGTERM: leaving at the next commit (at most %.0fs from now)", config.term_grace_s)

        def give_up():
            logger.error("no commit within term_grace_s (%.0fs) after SIGTERM: exiting now", config.term_grace_s)
            os._exit(LEAVE)

        timer = threading.Timer(config.term_grace_s, give_up)
        timer.daemon = True
        timer.start()

    relay = Relay(leave, "elastic_ext-sigterm")

    def handler(signum, frame):
        if asked or live.leaving():  # Event.is_set reads a flag: no lock
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        asked.append(True)
        relay.ring()

    handler.elastic_ext_sigterm = True
    handler.elastic_ext_relay = relay
    return signal.signal(signal.SIGTERM, handler)


def restore_sigterm(previous) -> None:
    """Puts back the handler :func:`install_sigterm` replaced; the one installed at import becomes SIG_DFL.

    After ``@elastic_ext.run`` returns there is no next commit to leave at.
    """
    if previous is None:
        return
    current = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if getattr(previous, "elastic_ext_sigterm", False) else previous)
    for replaced in (current, previous):  # after the handlers are gone: no later ring finds a pipe closed
        relay = getattr(replaced, "elastic_ext_relay", None)
        if relay is not None:
            relay.close()


def install_early_sigterm(environ=None, liveness: Optional[Liveness] = None):
    """Before the script of a worker of an elastic ``horovodrun`` runs (the launcher's entry): SIGTERM means leave.

    A newcomer spends seconds between its import and ``@elastic_ext.run``
    (building its model, in its first ``hvd.init()`` with the survivors):
    killed by a SIGTERM there, it failed the round that was forming (see
    :func:`install_sigterm`). Now the request is kept and honoured at its
    first commit. Not installed over a handler of the script's own, outside
    the main thread, or outside ``horovodrun``'s elastic mode. Returns the
    previous handler, or None when not installed.
    """
    env = os.environ if environ is None else environ
    if not elastic_horovodrun(env) or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    try:
        config = ElasticConfig.from_env(env)
    except ConfigError:
        return None  # the State's own config raises it, with its message
    return install_sigterm(config, liveness)

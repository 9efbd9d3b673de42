"""Gloo's timeout for a worker's ``hvd.init()``: the first one and every reset.

Horovod reads ``HOROVOD_GLOO_TIMEOUT_SECONDS`` at every ``hvd.init()`` and
uses it twice: as the wait for the round's members to connect, and as the
timeout of every collective of that Horovod context. A worker's first
``hvd.init()``, which runs before any elastic_ext code and may meet peers
that are still starting, waits ``rendezvous_timeout_s``
(:func:`first_rendezvous_timeout`, set before the user's code); a reset
waits ``collective_timeout_s`` where its round holds only running workers
(:func:`reset_timeout`, set by ``run`` before each reset).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from elastic_ext.config import ENV_HOROVOD_GLOO_TIMEOUT, ElasticConfig, elastic_horovodrun, launch_min_np, launched
from elastic_ext.errors import ConfigError

# The value this module set last (the first init's, then a reset's), which the next reset may replace.
_TIMEOUT_SET_AT_IMPORT: Optional[str] = None


def _timeout_value(seconds: float) -> str:
    return str(max(1, int(round(seconds))))


def reset_timeout(config: Any, size: int, environ: Any = None) -> Optional[str]:
    """Sets Horovod's Gloo timeout for the coming reset; returns the value in force.

    Under ``elastic-horovodrun`` a reset's round holds only running workers
    (:mod:`elastic_ext.launch.driver`), so the timeout is
    ``collective_timeout_s``: how long a collective then waits for a peer
    that does not answer. The exception is a reset that may have to refill
    the job to ``--min-np`` with freshly started workers (this world less
    one is below it): there, and under plain ``horovodrun`` where every reset
    may meet newcomers still starting, it is ``rendezvous_timeout_s``.
    Horovod reads ``HOROVOD_GLOO_TIMEOUT_SECONDS`` at every ``hvd.init()``;
    a value the user set is left alone.
    """
    global _TIMEOUT_SET_AT_IMPORT
    env = os.environ if environ is None else environ
    ours = ENV_HOROVOD_GLOO_TIMEOUT not in env or env[ENV_HOROVOD_GLOO_TIMEOUT] == _TIMEOUT_SET_AT_IMPORT
    min_np = launch_min_np(env)
    running_only = launched(env) and min_np is not None and size - 1 >= min_np
    seconds = config.collective_timeout_s if running_only else config.rendezvous_timeout_s
    if seconds and ours:
        env[ENV_HOROVOD_GLOO_TIMEOUT] = _TIMEOUT_SET_AT_IMPORT = _timeout_value(seconds)
    return env.get(ENV_HOROVOD_GLOO_TIMEOUT)


def first_rendezvous_timeout(environ: Any = None) -> Optional[str]:
    """Before the script of a worker of an elastic ``horovodrun`` runs: the same Gloo timeout for its first
    ``hvd.init()``, from the ``ELASTIC_EXT_*`` configuration, unless the user set one.

    A newcomer's first ``hvd.init()`` runs before any elastic_ext code: with
    Horovod's 30 s it gave up on a peer (another newcomer still importing, a
    survivor still restoring) that the survivors, under
    :func:`rendezvous_timeout`, still waited for. Returns the value set, or None.
    """
    global _TIMEOUT_SET_AT_IMPORT
    env = os.environ if environ is None else environ
    if not elastic_horovodrun(env) or ENV_HOROVOD_GLOO_TIMEOUT in env:
        return None
    try:
        seconds = ElasticConfig.from_env(env).rendezvous_timeout_s
    except ConfigError:
        return None  # the State's own config raises it, with its message
    if not seconds:
        return None
    env[ENV_HOROVOD_GLOO_TIMEOUT] = _TIMEOUT_SET_AT_IMPORT = _timeout_value(seconds)
    return _TIMEOUT_SET_AT_IMPORT

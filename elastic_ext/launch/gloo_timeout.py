"""Gloo's collective timeout for a worker's ``hvd.init()``: the first one and every reset.

Horovod reads ``HOROVOD_GLOO_TIMEOUT_SECONDS`` at every ``hvd.init()``. The
survivors' re-initialisation after a failure waits that long for newcomers
(:func:`rendezvous_timeout`, set by ``run``), and a newcomer's first
``hvd.init()``, which runs before any elastic_ext code, must wait as long
(:func:`first_rendezvous_timeout`, set before the user's code).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from elastic_ext.config import ENV_HOROVOD_GLOO_TIMEOUT, ElasticConfig, elastic_horovodrun
from elastic_ext.errors import ConfigError

# The value first_rendezvous_timeout() set at import, which a config given in code may replace.
_TIMEOUT_SET_AT_IMPORT: Optional[str] = None


def _timeout_value(seconds: float) -> str:
    return str(max(1, int(round(seconds))))


def rendezvous_timeout(config: Any, environ: Any = None) -> Optional[str]:
    """Sets Horovod's Gloo timeout for the resets to come (see ``ElasticConfig.rendezvous_timeout_s``).

    Horovod reads ``HOROVOD_GLOO_TIMEOUT_SECONDS`` at every ``hvd.init()``,
    so the survivors' re-initialisation after a failure waits this long for
    newcomers. A value the user set is left alone. Returns the value in force.
    """
    env = os.environ if environ is None else environ
    ours = ENV_HOROVOD_GLOO_TIMEOUT not in env or env[ENV_HOROVOD_GLOO_TIMEOUT] == _TIMEOUT_SET_AT_IMPORT
    if config.rendezvous_timeout_s and ours:
        env[ENV_HOROVOD_GLOO_TIMEOUT] = _timeout_value(config.rendezvous_timeout_s)
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

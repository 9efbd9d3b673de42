"""Discovery failure kinds, each mapped to one documented exit code.

All derive from :class:`elastic_ext.errors.DiscoveryError`. They live here,
not in ``elastic_ext/errors.py``, only until that module adopts them; the
import path ``elastic_ext.discovery.errors`` stays valid either way.
"""

from __future__ import annotations

from elastic_ext.errors import DiscoveryError


class DiscoveryInputError(DiscoveryError, ValueError):
    """Bad input or configuration: a malformed nodelist, host file or slot value,
    a missing region, a missing Python dependency. Retrying will not help."""


class DiscoveryUnavailableError(DiscoveryError):
    """The scheduler or cloud API is unreachable, missing, or answered with an error."""


class DiscoveryTimeoutError(DiscoveryUnavailableError):
    """A scheduler or cloud call, or the whole discovery run, exceeded its time bound."""


__all__ = ["DiscoveryInputError", "DiscoveryUnavailableError", "DiscoveryTimeoutError"]

"""Host entries and the rules every emitted host must follow.

Horovod 0.28.1 reads a discovery script's stdout line by line and splits
each line on ``:`` into host and slots
(``horovod/runner/elastic/discovery.py``); it later builds rendezvous keys
``host:local_rank`` and split them the same way, and passes hosts to ``ssh``
command lines. So a host we emit must be

- a hostname: dot-separated labels of letters, digits, ``-`` and ``_``
  (Horovod's own ``--hosts`` pattern is ``[\\w.-]+``), each label 1-63
  characters and not starting with ``-`` (ssh would read it as an option),
  at most 253 characters in all; or
- an IPv4 address in dotted-quad form.

A bracket-free IPv6 address is recognised but refused: every ``:`` in it
would break Horovod's ``line.split(':')``. Whitespace and shell
metacharacters never pass. Invalid entries are dropped with a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from elastic_ext.errors import DiscoveryInputError

logger = logging.getLogger(__name__)

MAX_HOSTNAME_LEN = 253
MAX_LABEL_LEN = 63
# A generous cap: more than this many slots on one host is a typo, not a machine.
MAX_SLOTS = 4096

_LABEL_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
_DOTTED_NUMERIC_RE = re.compile(r"^[0-9.]+$")
_SLOTS_RE = re.compile(r"^[0-9]+$")


class HostSlots:
    """One host Horovod may start workers on, and how many (``slots``); immutable, compared by value.

    A plain class, not a dataclass: a discovery script runs every second, and
    ``dataclasses`` (with ``inspect``) is a fifth of its imports.
    """

    __slots__ = ("host", "slots")

    def __init__(self, host: str, slots: int) -> None:
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "slots", slots)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"HostSlots is immutable: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not HostSlots:
            return NotImplemented
        return (self.host, self.slots) == (other.host, other.slots)

    def __hash__(self) -> int:
        return hash((self.host, self.slots))

    def __repr__(self) -> str:
        return f"HostSlots(host={self.host!r}, slots={self.slots!r})"

    def __reduce__(self) -> tuple:
        return HostSlots, (self.host, self.slots)  # copies and pickles rebuild it (no setattr)

    def line(self) -> str:
        """The ``host:slots`` line Horovod's discovery parser expects."""
        return f"{self.host}:{self.slots}"


def host_error(value: str) -> str | None:
    """Return why ``value`` cannot be emitted as a Horovod host, or None if it can.

    The reason quotes the value and names the rule it broke.
    """
    shown = repr(value)
    if not value:
        return "empty host name"
    if any(c.isspace() for c in value):
        return f"host {shown} contains whitespace"
    if ":" in value:
        import ipaddress  # only for the hosts that need it: a discovery script runs every second
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            return (f"host {shown} contains ':' "
                    "(Horovod splits each line on ':' into host and slots)")
        return (f"host {shown} is an IPv6 address; Horovod 0.28.1 splits discovery lines and "
                "rendezvous keys on ':', so IPv6 cannot be used: emit a hostname instead")
    if _DOTTED_NUMERIC_RE.match(value):
        import ipaddress
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            return f"host {shown} looks numeric but is not a dotted-quad IPv4 address"
        return None
    if len(value) > MAX_HOSTNAME_LEN:
        return f"host {shown} is longer than {MAX_HOSTNAME_LEN} characters"
    for label in value.split("."):
        if not label:
            return f"host {shown} has an empty label (leading, trailing or doubled '.')"
        if len(label) > MAX_LABEL_LEN:
            return f"host {shown} has a label longer than {MAX_LABEL_LEN} characters"
        if label.startswith("-"):
            return f"host {shown} has a label starting with '-' (ssh would read it as an option)"
        if not _LABEL_RE.match(label):
            return (f"host {shown} may contain only letters, digits, '-', '_' and '.' "
                    "(no shell metacharacters: Horovod passes hosts to ssh)")
    return None


def is_valid_host(value: str) -> bool:
    """True if ``value`` can be emitted as a Horovod host (see :func:`host_error`)."""
    return host_error(value) is None


def parse_slots(value: object, source: str) -> int:
    """Parse a slot count given as text or int, for example a tag value.

    Args:
        value: the raw slot count.
        source: where it came from, quoted in the error (``"tag 'slots' of i-123"``).

    Raises:
        DiscoveryInputError: ``value`` is not a whole number in ``[0, MAX_SLOTS]``.
    """
    text = str(value).strip()
    if not _SLOTS_RE.match(text):
        raise DiscoveryInputError(
            f"slot count {value!r} from {source} must be a non-negative integer")
    slots = int(text)
    if slots > MAX_SLOTS:
        raise DiscoveryInputError(
            f"slot count {slots} from {source} must be <= {MAX_SLOTS}")
    return slots


def usable_hosts(entries: Iterable[HostSlots]) -> list[HostSlots]:
    """Keep the entries Horovod can use, in order, warning about the rest.

    Drops invalid hosts, hosts with zero slots, and later duplicates of a host
    (Horovod keeps one slot count per host; the first one seen wins).
    """
    kept: list[HostSlots] = []
    seen = set()
    for entry in entries:
        reason = host_error(entry.host)
        if reason is not None:
            logger.warning("dropping host: %s", reason)
            continue
        if entry.slots <= 0:
            logger.info("dropping host %r: it has %d slots", entry.host, entry.slots)
            continue
        if entry.host in seen:
            logger.warning("dropping duplicate host %r (slots %d); keeping its first entry",
                           entry.host, entry.slots)
            continue
        seen.add(entry.host)
        kept.append(entry)
    return kept


def render(entries: Iterable[HostSlots]) -> str:
    """The exact stdout of a discovery script: one ``host:slots`` line per usable host."""
    return "".join(entry.line() + "\n" for entry in usable_hosts(entries))


__all__ = ["HostSlots", "host_error", "is_valid_host", "parse_slots", "usable_hosts", "render",
           "MAX_SLOTS"]

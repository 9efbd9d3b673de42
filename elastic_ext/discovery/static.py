"""Hosts from a plain host file, minus an exclude list.

The file is read again on every call, so editing it (or the exclude file)
while a job runs makes Horovod shrink or grow it. Accepted lines::

    # a comment; blank lines are ignored too
    worker-1            # slots from --slots (default 1)
    worker-2:4          # Horovod style
    10.0.0.7 slots=8    # OpenMPI hostfile style

A malformed line is an input error for the whole file (exit 2), since
guessing which hosts the author meant would start workers in the wrong place.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

from elastic_ext.discovery.hosts import HostSlots, parse_slots
from elastic_ext.errors import DiscoveryInputError

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 1

_HOST_RE = r"(?P<host>[^\s:=#]+)"
_LINE_RES = (
    re.compile(r"^" + _HOST_RE + r"$"),
    re.compile(r"^" + _HOST_RE + r":(?P<slots>\S+)$"),
    re.compile(r"^" + _HOST_RE + r"\s+slots\s*=\s*(?P<slots>\S+)$"),
)


def parse_host_lines(lines: Iterable[str], source: str,
                     default_slots: int = DEFAULT_SLOTS) -> list[HostSlots]:
    """Parse host-file lines (see the module docstring) into entries, in file order.

    Host names are checked later, by :func:`elastic_ext.discovery.hosts.usable_hosts`,
    so one bad name drops that host with a warning instead of the whole file.

    Raises:
        DiscoveryInputError: a line fits none of the accepted forms, or has a bad slot count.
    """
    entries: list[HostSlots] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{source} line {number}"
        for rx in _LINE_RES:
            match = rx.match(text)
            if match:
                break
        else:
            raise DiscoveryInputError(
                f"{where}: {text!r} must be 'HOST', 'HOST:SLOTS' or 'HOST slots=N'")
        slots_text = match.groupdict().get("slots")
        slots = default_slots if slots_text is None else parse_slots(slots_text, where)
        entries.append(HostSlots(match.group("host"), slots))
    return entries


def _read_text(path: str | os.PathLike[str]) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def read_host_file(path: str | os.PathLike[str], default_slots: int = DEFAULT_SLOTS) -> list[HostSlots]:
    """Read and parse a host file.

    Raises:
        DiscoveryInputError: it cannot be read, or a line is malformed.
    """
    try:
        text = _read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise DiscoveryInputError(f"cannot read host file {str(path)!r}: {exc}") from exc
    return parse_host_lines(text.splitlines(), repr(str(path)), default_slots)


def read_exclude_file(path: str | os.PathLike[str]) -> set[str]:
    """Host names listed in an exclude file, one per line, ``#`` comments allowed.

    A missing file means "exclude nothing": an operator can create it to
    drain a host and delete it to bring the host back.

    Raises:
        DiscoveryInputError: it exists but cannot be read.
    """
    try:
        text = _read_text(path)
    except FileNotFoundError:
        logger.info("exclude file %r does not exist: excluding nothing", str(path))
        return set()
    except (OSError, UnicodeDecodeError) as exc:
        raise DiscoveryInputError(f"cannot read exclude file {str(path)!r}: {exc}") from exc
    names = set()
    for raw in text.splitlines():
        for word in raw.split("#", 1)[0].split():
            names.add(word)
    return names


def discover(host_file: str | os.PathLike[str], exclude: Iterable[str] = (),
             exclude_file: str | os.PathLike[str] | None = None,
             default_slots: int = DEFAULT_SLOTS) -> list[HostSlots]:
    """The hosts of ``host_file`` not named in ``exclude`` or ``exclude_file``.

    Raises:
        DiscoveryInputError: a file cannot be read or is malformed.
    """
    excluded = set(exclude)
    if exclude_file is not None:
        excluded |= read_exclude_file(exclude_file)
    kept = []
    for entry in read_host_file(host_file, default_slots):
        if entry.host in excluded:
            logger.info("leaving out host %r: it is excluded", entry.host)
            continue
        kept.append(entry)
    return kept


__all__ = ["DEFAULT_SLOTS", "parse_host_lines", "read_host_file", "read_exclude_file", "discover"]

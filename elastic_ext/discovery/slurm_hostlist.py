"""Slurm's compact list syntaxes, read and written through python-hostlist.

Owns the two notations Slurm uses to name many nodes and counts in one
string: hostlist expressions (``node[01-03,07],gpu1``, both ways: expanded
into names and collected back into an expression for ``scontrol``) and
per-node count lists (``2(x3),1`` in ``SLURM_TASKS_PER_NODE``,
``a100:2,v100:1`` in ``SLURM_GPUS_PER_NODE``). Pure parsing, no environment
and no controller: :mod:`elastic_ext.discovery.slurm` decides which
variables to read and asks Slurm about the nodes.

python-hostlist is imported when first needed, so that a script's
``--help`` works without it.
"""

from __future__ import annotations

import sys
from typing import Any, List, Sequence

from elastic_ext.discovery.hosts import parse_slots
from elastic_ext.errors import DiscoveryInputError


def _hostlist() -> Any:
    """python-hostlist, imported late so that ``--help`` works without it."""
    try:
        import hostlist
    except ImportError as exc:
        raise DiscoveryInputError(
            f"python-hostlist is not installed for {sys.executable}: "
            "pip install 'python-hostlist>=1.23'") from exc
    return hostlist


def expand_nodelist(expr: str) -> List[str]:
    """Expand a Slurm hostlist expression (``node[01-03,07],gpu1``) into names.

    Raises:
        DiscoveryInputError: the expression is malformed or empty.
    """
    hostlist = _hostlist()
    try:
        names = hostlist.expand_hostlist(expr)
    except hostlist.BadHostlist as exc:
        raise DiscoveryInputError(
            f"nodelist {expr!r} is not a valid Slurm hostlist expression: {exc}") from exc
    if not names:
        raise DiscoveryInputError(f"nodelist {expr!r} expands to no hosts")
    return names


def collect_nodelist(names: Sequence[str]) -> str:
    """The hostlist expression of ``names`` (``["n1", "n2", "n3"]`` -> ``n[1-3]``)."""
    return _hostlist().collect_hostlist(names)


def parse_per_node(expr: str, n_nodes: int, source: str) -> List[int]:
    """Parse a per-node count list such as ``2(x3),1`` into one count per node.

    Raises:
        DiscoveryInputError: malformed, or its length is not ``n_nodes``.
    """
    hostlist = _hostlist()
    try:
        counts = hostlist.parse_slurm_tasks_per_node(expr.strip())
    except hostlist.BadHostlist as exc:
        raise DiscoveryInputError(
            f"{source} {expr!r} must look like '2(x3),1' (count, optional (xREPEAT), "
            f"comma-separated): {exc}") from exc
    if len(counts) != n_nodes:
        raise DiscoveryInputError(
            f"{source} {expr!r} gives {len(counts)} counts for {n_nodes} nodes")
    return counts


def parse_gpus_per_node(expr: str, source: str) -> int:
    """Total GPUs per node from a GPU list (``2``, ``a100:2``, ``a100:2,v100:1``).

    ``source`` names where ``expr`` came from, for the error message.

    Raises:
        DiscoveryInputError: a part does not end in a GPU count.
    """
    total = 0
    for part in expr.split(","):
        total += parse_slots(part.strip().rsplit(":", 1)[-1], f"{source} {expr!r}")
    return total


__all__ = ["expand_nodelist", "collect_nodelist", "parse_per_node", "parse_gpus_per_node"]

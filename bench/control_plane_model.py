"""The figures of :mod:`bench.control_plane` read from this machine, and the extrapolation of a reset that
did not end in its bound (Gloo's rendezvous through the store)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from bench.control_plane_sim import ADDRESS_BYTES


def driver_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listen_overflows() -> int:
    """This machine's count of connections its listening sockets dropped because their accept queue was full
    (``TcpExt: ListenOverflows``; the whole machine's, which this run dominates while it runs)."""
    with open("/proc/net/netstat") as handle:
        lines = handle.read().splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split()[1:], values.split()[1:])).get("ListenOverflows", 0))
    return 0


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gloo_requests(size: int, exchange: bool = False) -> int:
    """The fewest store requests of one Gloo context of ``size`` ranks (no read of a missing key); with the
    full-mesh exchange (build patch 08) a rank's one request (none held past the last rank) and no ``DELETE``."""
    if exchange and size > 1:
        return size
    return 3 * size + size * (size - 1) // 2 + 2 * size * (size - 1)


def extrapolate(reset: Dict[str, Any], size: int, slots: int, timeout_s: float,
                exchange: bool = False) -> Dict[str, Any]:
    """For a reset that did not end in its bound: Gloo's requests it needs, and two estimates of their time
    (``exchange``: a Horovod built with patches 08 and 09, as after issue 55's changes).

    ``at_store_rate_s``: at the rate the store answered in the phase (all its requests, polls included, as if
    all went to Gloo: a lower bound while the polls go on); ``at_one_core_s``: at the driver's measured CPU per
    request on a core of its own (Python's store runs on one), small requests' cost (Gloo's address values,
    136 bytes per peer, cost more). The larger is the extrapolation.
    """
    local = [slots] * (size // slots) + ([size % slots] if size % slots else [])
    # Global, local and cross contexts; as released again for the global process set (patch 09: shared).
    contexts = (gloo_requests(size, exchange) + sum(gloo_requests(s, exchange) for s in local)
                + sum(gloo_requests(len([h for h in local if h > lr]), exchange) for lr in range(slots)))
    total = (1 if exchange else 2) * contexts
    rate = reset["requests_per_s"] or 0.0
    at_rate = total / rate if rate else None
    at_core = total * reset["driver_cpu_ms_per_request"] / 1000.0
    return {"gloo_requests_done": reset["by_kind"].get("gloo", 0), "gloo_requests_needed": total,
            "gloo_bytes_read_needed": (1 if exchange else 4 * (size - 1)) * size * (size - 1) * ADDRESS_BYTES,
            "store_requests_per_s": rate, "driver_cpu_ms_per_request": reset["driver_cpu_ms_per_request"],
            "at_store_rate_s": None if at_rate is None else round(at_rate, 1), "at_one_core_s": round(at_core, 1),
            "round_formed_s_extrapolated": round(max(at_rate or 0.0, at_core), 1),
            "note": f"the reset did not end in its bound ({timeout_s} s): Gloo's rendezvous alone need "
                    f"{total} store requests ({'about 3 N' if exchange else 'about 5 N^2 (1 + 1/slots)'}); "
                    f"the time given is the larger of the two estimates (at the store's measured rate, at its "
                    f"measured CPU per request)"}

"""The compact form of Gloo pair addresses that build patch 08's ``HTTPStore`` sends and reads.

A rank's TCP pair addresses (136 bytes each: a sockaddr and a sequence
number) differ from one another only in a few bytes (the port; across hosts
the host's address too). The compact form of ``count`` addresses of ``item``
bytes: a 16-bit little-endian count K, K rising 16-bit offsets, the first
address whole, then of each address its bytes at the K offsets. Offsets
where no address differs are allowed (the form stays exact).
:mod:`elastic_ext.launch.gloo_exchange` keeps a rank's addresses in this form
(:func:`unpack`), never whole, and expands them (:func:`expand`) only for a
reader of Gloo's own protocol.
"""

from __future__ import annotations

from typing import Any, NamedTuple

_OFFSETS = "<u2"  # the count and the offsets, 16-bit little-endian


class Packed(NamedTuple):
    """Addresses in compact form, checked: ``offsets`` (K rising indices below ``item``), ``first`` (the first
    address, ``item`` bytes) and ``rows`` (``count`` x K bytes: each address at the offsets), numpy arrays
    viewing the data they were read from."""
    offsets: Any
    first: Any
    rows: Any


def head(offsets: Any, first: Any) -> bytes:
    """The compact form's head: the count of ``offsets``, the offsets, and the ``first`` address whole."""
    return len(offsets).to_bytes(2, "little") + offsets.astype(_OFFSETS).tobytes() + first.tobytes()


def compact(items: bytes, count: int, item: int) -> bytes:
    """``count`` addresses of ``item`` bytes in compact form, with the offsets where any address differs from
    the first, as the patched ``HTTPStore`` sends them."""
    import numpy

    if count == 0:
        return b"\0\0"
    array = numpy.frombuffer(items, dtype=numpy.uint8).reshape(count, item)
    offsets = numpy.flatnonzero((array != array[0]).any(axis=0))
    return head(offsets, array[0]) + array[:, offsets].tobytes()


def unpack(data: bytes, count: int, item: int, what: str) -> Packed:
    """The ``count`` addresses of ``item`` bytes that ``data`` holds in compact form, checked (``count`` > 0).

    Raises:
        ValueError: naming ``what`` and the fault, where ``data`` is not that form (its length does not match
            its count of offsets, an offset is not below ``item`` or not above the one before it).
    """
    import numpy

    k = int.from_bytes(data[:2], "little") if len(data) >= 2 else -1
    expected = 2 + 2 * k + item + count * k
    if not 0 <= k <= item or len(data) != expected:
        raise ValueError(f"{what}: expected compact addresses (a count K of at most {item} offsets, K offsets, "
                         f"one address of {item} bytes and {count} x K bytes), got {len(data)} bytes"
                         + (f" for K = {k} ({expected} expected)" if k >= 0 else ""))
    offsets = numpy.frombuffer(data, dtype=_OFFSETS, count=k, offset=2).astype(numpy.intp)
    if k and (offsets[-1] >= item or (numpy.diff(offsets) <= 0).any()):
        raise ValueError(f"{what}: the offsets {offsets[:8].tolist()}{'...' if k > 8 else ''} must rise and stay "
                         f"below the address's {item} bytes")
    first = numpy.frombuffer(data, dtype=numpy.uint8, count=item, offset=2 + 2 * k)
    rows = numpy.frombuffer(data, dtype=numpy.uint8, count=count * k, offset=2 + 2 * k + item).reshape(count, k)
    return Packed(offsets, first, rows)


def expand(data: bytes, count: int, item: int, what: str) -> bytes:
    """The ``count`` addresses of ``item`` bytes, whole, that ``data`` holds in compact form.

    Raises:
        ValueError: as :func:`unpack`; for ``count`` 0, ``data`` other than no addresses.
    """
    import numpy

    if count == 0:
        if data not in (b"", b"\0\0"):
            raise ValueError(f"{what}: expected no addresses, got {len(data)} bytes")
        return b""
    packed = unpack(data, count, item, what)
    array = numpy.tile(packed.first, (count, 1))
    array[:, packed.offsets] = packed.rows
    return array.tobytes()


__all__ = ["Packed", "compact", "expand", "head", "unpack"]

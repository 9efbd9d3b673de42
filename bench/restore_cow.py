"""Restoring a large tensor by copying the commit back against remapping it copy-on-write.

A design tried for the 432 MB recovery (``bench.recovery --models mlp,table``)
and not adopted; this keeps its figures reproducible. Run from the repository
root::

    .venv/bin/python -m bench.restore_cow

One process holds a float32 tensor (``--mib``, 432 by default, at least 32) and its commit
in a memfd, laid out so that the tensor's pages and the file's pages line up.
Each round dirties a ``--slice-mib`` slice (the steps since the commit), then
restores the commit in one of two ways, alternating A B B A:

- ``copy``: ``tensor.copy_(commit)``, what ``State.restore()`` does;
- ``remap``: the tensor's whole pages are replaced by a private mapping of the
  memfd (``mmap(MAP_FIXED | MAP_PRIVATE)``), its partial first and last pages
  copied: no byte moves until a step writes a page, which the kernel then
  copies (4 KiB at a time).

After each restore it times one sparse step (a ``--slice-mib`` slice written
in place, like the table's step) and one dense step (every element written,
like an optimizer's step over a model), and checks that the tensor equals the
commit after the restore and that the steps left the commit unchanged.
Before each round the tensor is put back on private anonymous pages, so that
no round starts from the previous one's mapping.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import zlib
from typing import Dict, List

import numpy as np

from bench import harness

NAME = "restore_cow"
PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10  # Linux
# glibc gives an allocation this large a mapping of its own (its mmap threshold is at most 32 MiB on
# 64-bit), so the remap replaces pages of the tensor alone, never of the heap that malloc reuses.
MIN_MIB = 32


def _libc_mmap():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc.mmap


class Table:
    """A tensor of ``nbytes`` and its commit in a memfd whose offset matches the tensor's place in its page."""

    def __init__(self, nbytes: int) -> None:
        import torch

        if nbytes < MIN_MIB << 20:
            raise ValueError(f"a table of {nbytes} bytes: expected at least {MIN_MIB} MiB, so that it has a "
                             "mapping of its own")
        self._mmap = _libc_mmap()
        self.tensor = torch.arange(nbytes // 4, dtype=torch.float32)
        self.address = self.tensor.data_ptr()
        self.head = self.address % PAGE                       # the tensor's offset in its first page
        self.first = self.address + (-self.address % PAGE)    # its first whole page
        self.end = (self.address + nbytes) // PAGE * PAGE     # the end of its last whole page
        self.fd = os.memfd_create("elastic_ext-bench-commit")
        os.ftruncate(self.fd, self.head + nbytes + PAGE)
        self._file = mmap.mmap(self.fd, self.head + nbytes + PAGE, mmap.MAP_SHARED)
        self.commit = np.frombuffer(self._file, dtype=np.float32, count=nbytes // 4, offset=self.head)
        self.live = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.address)).view(np.float32)
        np.copyto(self.commit, self.live)

    def _map(self, flags: int, fd: int, offset: int) -> None:
        got = self._mmap(self.first, self.end - self.first, mmap.PROT_READ | mmap.PROT_WRITE,
                         flags | MAP_FIXED, fd, offset)
        if got != self.first:
            raise OSError(ctypes.get_errno(), f"mmap over the tensor's pages returned {got}, not {self.first}")

    def anonymous(self) -> None:
        """Puts the tensor back on private anonymous pages holding the commit (untimed set-up)."""
        self._map(mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        np.copyto(self.live, self.commit)

    def restore_copy(self) -> None:
        import torch

        self.tensor.copy_(torch.from_numpy(self.commit))

    def restore_remap(self) -> None:
        self._map(mmap.MAP_PRIVATE, self.fd, self.first - self.address + self.head)
        live, commit = self.live.view(np.uint8), self.commit.view(np.uint8)
        split_head, split_tail = self.first - self.address, self.end - self.address
        np.copyto(live[:split_head], commit[:split_head])
        np.copyto(live[split_tail:], commit[split_tail:])


def one_round(table: Table, method: str, slice_elems: int, rng: np.random.Generator) -> Dict[str, float]:
    """Dirty, restore by ``method``, one sparse and one dense step; checks the bytes. Seconds per phase."""
    import torch

    table.anonymous()
    crc = zlib.crc32(table.commit)
    start = int(rng.integers(0, table.tensor.numel() - slice_elems))
    table.tensor[start:start + slice_elems] += 1.0
    restore_s, _ = harness.timed(table.restore_copy if method == "copy" else table.restore_remap)
    if not torch.equal(table.tensor, torch.from_numpy(table.commit)):
        raise AssertionError(f"{method}: the tensor differs from the commit after the restore")
    start = int(rng.integers(0, table.tensor.numel() - slice_elems))
    sparse_s, _ = harness.timed(lambda: table.tensor[start:start + slice_elems].add_(1.0))
    dense_s, _ = harness.timed(lambda: table.tensor.add_(1.0))
    if zlib.crc32(table.commit) != crc:
        raise AssertionError(f"{method}: the steps after the restore changed the commit")
    return {"restore_s": restore_s, "sparse_step_s": sparse_s, "dense_step_s": dense_s}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=432, help="tensor size in MiB")
    parser.add_argument("--slice-mib", type=int, default=4, help="bytes a sparse step writes, in MiB")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per method (even: A B B A)")
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)
    if args.mib < MIN_MIB or not 1 <= args.slice_mib < args.mib:
        parser.error(f"--mib {args.mib} and --slice-mib {args.slice_mib}: expected a tensor of at least {MIN_MIB} "
                     "and 1 <= slice < tensor")
    table = Table(args.mib << 20)
    rng = np.random.default_rng(0)
    samples: Dict[str, List[Dict[str, float]]] = {"copy": [], "remap": []}
    order = ["copy", "remap", "remap", "copy"]
    for number in range(2 * args.rounds):
        method = order[number % 4]
        samples[method].append(one_round(table, method, (args.slice_mib << 20) // 4, rng))
    phases = ("restore_s", "sparse_step_s", "dense_step_s")
    medians = {m: {p: harness.median([s[p] for s in samples[m]]) for p in phases} for m in samples}
    for m in medians:
        medians[m]["restore_and_sparse_s"] = medians[m]["restore_s"] + medians[m]["sparse_step_s"]
        medians[m]["restore_and_dense_s"] = medians[m]["restore_s"] + medians[m]["dense_step_s"]
    ratios = {p: harness.ratio(medians["remap"][p], medians["copy"][p]) for p in medians["copy"]}
    print(harness.table(["median (s)", "copy", "remap", "remap / copy"],
                        [[p, medians["copy"][p], medians["remap"][p], ratios[p]] for p in medians["copy"]]))
    path = harness.write_json(args.name, {
        "machine": harness.machine(mib=args.mib, slice_mib=args.slice_mib, rounds=args.rounds),
        "samples": samples, "medians": medians, "remap_over_copy": ratios})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

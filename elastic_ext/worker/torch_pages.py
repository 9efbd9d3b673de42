"""PyTorch's large tensors in huge pages: set in a worker before its script imports torch.

PyTorch's CPU allocator asks the kernel for transparent huge pages for an
allocation of 2 MiB or more only when ``THP_MEM_ALLOC_ENABLE=1`` is in its
environment at its first allocation. Without it, where the kernel's THP
mode is ``madvise`` (the default of most distributions), a tensor lives in
4 KiB pages. NumPy asks for huge pages itself, so the commit buffers of
elastic_ext's State already have them.

:func:`install` (run by the launcher's worker entry) sets the variable
unless the worker's environment already holds it: a user's
``THP_MEM_ALLOC_ENABLE=0`` stands. It matters to an elastic job because
its survivors learn of a killed worker from the close of its links, and the
kernel frees a process's memory before it closes its sockets, one 4 KiB page
after another but a huge page at a time: a worker holding a 432 MB tensor
and its commit buffer closed its links 0.069 s after SIGKILL with the
tensor in 4 KiB pages and 0.021 s with it in huge pages, here
(``python -m bench.kill_close``). Commits and rollbacks still copy only the written 4 KiB pages
(:mod:`elastic_ext.state.written`): the first write after a commit's scan
maps that huge page with 4 KiB entries and leaves the memory where it is.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def install(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Sets :data:`VARIABLE` to ``1`` unless it is set; True if this call set it."""
    env = os.environ if environ is None else environ
    if VARIABLE in env:
        return False
    env[VARIABLE] = "1"
    return True

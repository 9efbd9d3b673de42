"""The torch part of :class:`elastic_ext.GlobalRNG`: CPU and CUDA default generators.

Registered with the core by ``elastic_ext.torch`` on import.
"""

from __future__ import annotations

import numpy as np
import torch

from elastic_ext.state.snapshot import Capture, Entry, NumpySource


def capture_global() -> Capture:
    """The default generators' states, copied now (they are small)."""
    arrays = {"cpu": NumpySource(torch.get_rng_state().numpy().copy())}
    cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            arrays[f"cuda{index}"] = NumpySource(state.numpy().copy())
        cuda = torch.cuda.device_count()
    return Capture(arrays=arrays, meta={"cuda_devices": cuda})


def apply_global(entry: Entry) -> None:
    """Puts the committed CPU and CUDA generator states back."""
    torch.set_rng_state(torch.from_numpy(np.array(entry.arrays["cpu"], copy=True)))
    # Per rank and never broadcast, so the device count is this process's own;
    # a process that has not initialised CUDA since the commit restores none.
    count = min(int(entry.meta["cuda_devices"]), torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for index in range(count):
        torch.cuda.set_rng_state(torch.from_numpy(np.array(entry.arrays[f"cuda{index}"], copy=True)), index)

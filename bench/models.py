"""The benchmarks' one model builder: a seeded MLP.

Used by the drivers (bench/commit.py, bench/checkpoint.py) and by the
workers horovodrun and torchrun start as scripts (bench/workers/), which
import it as ``bench.models``: their launches put the repository root on
``PYTHONPATH`` (``devkit.launch.base_env``). torch is imported
on the first call, so a driver that only launches jobs never loads it.
"""

from __future__ import annotations

from typing import Any, Sequence


def mlp(widths: Sequence[int], activation: str = "ReLU", seed: int = 0) -> Any:
    """``torch.nn.Sequential`` of ``Linear(widths[i], widths[i + 1])``, ``activation`` between them.

    ``activation`` names a ``torch.nn`` module (``"ReLU"``, ``"GELU"``). The
    parameters are drawn right after ``torch.manual_seed(seed)``, so every
    process (and every system of a benchmark) starts from the same model.
    """
    import torch

    if len(widths) < 2:
        raise ValueError(f"an MLP needs an input and an output width, got widths {list(widths)}")
    torch.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(getattr(torch.nn, activation)())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    return torch.nn.Sequential(*layers)

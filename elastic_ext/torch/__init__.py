"""PyTorch support: adapters for modules, optimizers, schedulers, scalers and
RNGs, the Horovod binding, and the elastic sampler for ``DataLoader``.

The only package of elastic_ext that imports torch. Importing it registers
its adapters and its part of :class:`elastic_ext.GlobalRNG` with the core
(:mod:`elastic_ext.state.adapters`), which loads this package by itself once
torch is imported.
"""

from elastic_ext.state import adapters as _core
from elastic_ext.torch import adapters as _adapters
from elastic_ext.torch import rng as _rng
from elastic_ext.torch.sampler import ElasticSampler, PadIndex, PaddedDataset

_core.register_adapters("torch", _adapters.adapters)
_core.register_global_rng("torch", _rng.capture_global, _rng.apply_global)

__all__ = ["ElasticSampler", "PadIndex", "PaddedDataset"]

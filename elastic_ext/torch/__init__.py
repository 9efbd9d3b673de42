"""PyTorch support: adapters for modules, optimizers, schedulers, scalers and
RNGs, the Horovod binding, and the elastic sampler for ``DataLoader``.

The only package of elastic_ext that imports torch.
"""

from elastic_ext.torch.sampler import ElasticSampler, PadIndex, PaddedDataset

__all__ = ["ElasticSampler", "PadIndex", "PaddedDataset"]

"""The elastic sampler for PyTorch ``DataLoader`` (as its ``batch_sampler``)."""

from __future__ import annotations

from typing import Any, Iterator, List, Sized

import torch.utils.data

from elastic_ext.data.sampler import ElasticPartitioner


class PadIndex(int):
    """An index handed out only to pad the last step of an epoch (policy "pad")."""

    __slots__ = ()


class ElasticSampler(ElasticPartitioner, torch.utils.data.Sampler):
    """Yields this rank's batch of indices per step; use as ``DataLoader(batch_sampler=...)``.

    Works with ``num_workers > 0``: batches are planned in the main process,
    and the position only moves when :meth:`record_step` is called after a
    step, so prefetched batches never count as processed.

    Args:
        dataset: a sized dataset, or the number of samples.
        **kwargs: as :class:`elastic_ext.data.sampler.ElasticPartitioner`.
    """

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        size = dataset if isinstance(dataset, int) else len(dataset)
        if kwargs.get("world") is None:
            import horovod.torch as hvd
            kwargs["world"] = lambda: (hvd.rank(), hvd.size())
        ElasticPartitioner.__init__(self, size, **kwargs)

    def __iter__(self) -> Iterator[List[int]]:
        for indices, pad in self.batches():
            yield [PadIndex(i) if p else int(i) for i, p in zip(indices.tolist(), pad.tolist())]

    def __len__(self) -> int:
        return ElasticPartitioner.__len__(self)


class PaddedDataset(torch.utils.data.Dataset):
    """Wraps a dataset so each item comes with ``is_pad`` (True for padding)."""

    def __init__(self, dataset: Sized) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[int(index)], isinstance(index, PadIndex)

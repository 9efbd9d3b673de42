"""The epoch's order: a permutation of ``range(size)`` computed per position.

Owns :class:`EpochOrder` and its three kinds (identity, explicit array, and
the keyed shuffle :class:`FeistelOrder`, whose cipher, round keys and mixing
function are :mod:`elastic_ext.data.feistel`'s), and :func:`epoch_order`,
which picks one for an epoch. An order is *virtual*: the index at any
position is computed when asked for, so no array of ``size`` entries is
built (below ``SMALL_SIZE`` samples, 4,096, the shuffle computes its whole
order at its first use: 32 KB at most). Cutting the order into global
steps and rank shares is :mod:`elastic_ext.data.partition`'s job, which
re-exports these names.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from elastic_ext.data.feistel import ROUNDS, SMALL_ROUNDS, SMALL_SIZE, FeistelNetwork, round_keys
from elastic_ext.errors import PartitionError

_MAX_SIZE = (1 << 63) - 1         # indices are returned as int64


def index_dtype(size: int) -> np.dtype:
    """The narrowest signed integer type that holds ``size`` indices."""
    return np.dtype(np.int32) if size < 2 ** 31 else np.dtype(np.int64)


class EpochOrder:
    """An epoch's order: position ``p`` of the epoch serves sample ``order[p]``.

    Indexing computes entries on demand: ``order[p]`` (an int),
    ``order[a:b]`` and ``order.take(positions)`` (arrays of
    :func:`index_dtype`), each in time and memory proportional to the number
    of positions asked for, not to :attr:`size`. ``order[:]`` materialises
    the whole order (tests, small datasets).
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, (int, np.integer)) or not 0 <= size <= _MAX_SIZE:
            raise PartitionError(f"size ({size!r}) must be an integer in [0, 2**63)")
        self.size = int(size)
        self.dtype = index_dtype(self.size)

    def __len__(self) -> int:
        return self.size

    def _compute(self, positions: np.ndarray) -> np.ndarray:
        """Indices at ``positions`` (int64, already checked to be in range), any integer dtype."""
        raise NotImplementedError

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The indices at ``positions`` (any shape, each in ``[0, size)``).

        Raises:
            PartitionError: a position is outside ``[0, size)``.
        """
        positions = self._checked(positions, "position")
        if positions.size == 0:
            return np.zeros(positions.shape, dtype=self.dtype)
        return self._compute(positions).astype(self.dtype, copy=False)

    def _invert(self, indices: np.ndarray) -> np.ndarray:
        """Positions of ``indices`` (int64, already checked to be in range), any integer dtype."""
        raise NotImplementedError

    def positions_of(self, indices: np.ndarray) -> np.ndarray:
        """The inverse permutation: where each of ``indices`` comes in the epoch (int64).

        Raises:
            PartitionError: an index is outside ``[0, size)``.
        """
        indices = self._checked(indices, "index")
        if indices.size == 0:
            return np.zeros(indices.shape, dtype=np.int64)
        return self._invert(indices).astype(np.int64, copy=False)

    def _checked(self, values: np.ndarray, what: str) -> np.ndarray:
        values = np.asarray(values)
        if values.size == 0:
            return values
        if values.dtype.kind not in "iu":
            raise PartitionError(f"{what} values must be integers, got dtype {values.dtype}")
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= self.size:
            bad = low if low < 0 else high
            raise PartitionError(f"{what} ({bad}) must be in [0, {self.size}) for an epoch of {self.size} samples")
        return values.astype(np.int64, copy=False)

    def __getitem__(self, key: Union[int, slice, np.ndarray]) -> Union[int, np.ndarray]:
        if isinstance(key, slice):
            return self.take(np.arange(*key.indices(self.size), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            position = int(key) + (self.size if key < 0 else 0)
            if not 0 <= position < self.size:
                raise IndexError(f"position ({key}) out of range for an epoch of {self.size} samples")
            return int(self.take(np.array([position], dtype=np.int64))[0])
        return self.take(key)


class IdentityOrder(EpochOrder):
    """``order[p] == p``: the order without shuffling."""

    def _compute(self, positions: np.ndarray) -> np.ndarray:
        return positions.copy()  # never hand the caller's array back as the result

    def _invert(self, indices: np.ndarray) -> np.ndarray:
        return indices.copy()

    def __repr__(self) -> str:
        return f"IdentityOrder(size={self.size})"


class ArrayOrder(EpochOrder):
    """An order given as an explicit array (a permutation built elsewhere, or a test's)."""

    def __init__(self, order: np.ndarray) -> None:
        order = np.asarray(order)
        if order.ndim != 1 or order.dtype.kind not in "iu":
            raise PartitionError(f"an order must be a 1-D integer array, got shape {order.shape} "
                                 f"and dtype {order.dtype}")
        super().__init__(int(order.shape[0]))
        self.array = order
        self.dtype = order.dtype

    def _compute(self, positions: np.ndarray) -> np.ndarray:
        return self.array[positions]

    def _invert(self, indices: np.ndarray) -> np.ndarray:
        inverse = np.full(self.size, -1, dtype=np.int64)
        inverse[self.array] = np.arange(self.size, dtype=np.int64)
        if (inverse < 0).any():
            raise PartitionError(f"the array order is not a permutation of range({self.size}): "
                                 f"index {int(np.argmax(inverse < 0))} never comes")
        return inverse[indices]

    def __repr__(self) -> str:
        return f"ArrayOrder(size={self.size})"


class FeistelOrder(EpochOrder):
    """A keyed pseudo-random permutation of ``range(size)``, computed per position.

    The order is a :class:`~elastic_ext.data.feistel.FeistelNetwork` (its
    docstring tells the construction) keyed by :func:`round_keys` of
    ``(seed, epoch)``, with :data:`ROUNDS` rounds (:data:`SMALL_ROUNDS` below
    :data:`SMALL_SIZE` samples): ``order[p]`` is the network's image of ``p``
    and :meth:`positions_of` its inverse.

    Guarantees: a true permutation for every size (``0`` and ``1`` included, where there is nothing
    to shuffle); the same in every process (integer arithmetic only); time per position independent
    of ``size``; ``O(1)`` state (the round keys). Statistical quality (uniform positions and pairs
    of positions over seeds, unrelated orders from one epoch to the next) is checked by the unit
    tests. Below :data:`SMALL_SIZE` samples the whole order is computed once, at its first use, and
    looked up after that (:meth:`_small_table`). Not every one of the ``size!`` orders can come
    out: there are at most ``2**64`` keys, and a round only composes cyclic shifts of rows or
    columns, which for some radices reaches only even permutations of the rectangle; what a
    shuffle needs is that any position, or pair of positions, lands anywhere with equal
    probability, and that is what is tested. It is a shuffle, not a cipher: its keys are not meant
    to withstand an adversary.
    """

    def __init__(self, size: int, seed: int, epoch: int, rounds: Optional[int] = None) -> None:
        super().__init__(size)
        if rounds is None:
            rounds = ROUNDS if self.size >= SMALL_SIZE else SMALL_ROUNDS
        if rounds < 2 or rounds % 2:
            raise PartitionError(f"rounds ({rounds}) must be an even number >= 2 so both parts are mixed")
        self.seed, self.epoch = int(seed), int(epoch)
        self.network = FeistelNetwork(self.size, round_keys(self.seed, self.epoch, rounds))
        self.keys = self.network.keys
        self.high_radix, self.low_radix = self.network.high_radix, self.network.low_radix
        self._table: Optional[np.ndarray] = None
        self._inverse: Optional[np.ndarray] = None

    def __repr__(self) -> str:
        return f"FeistelOrder(size={self.size}, seed={self.seed}, epoch={self.epoch})"

    def _compute(self, positions: np.ndarray) -> np.ndarray:
        table = self._small_table()
        return self.network.permute(positions) if table is None else table[positions]

    def _invert(self, indices: np.ndarray) -> np.ndarray:
        table = self._small_table()
        if table is None:
            return self.network.invert(indices)
        if self._inverse is None:
            self._inverse = np.empty(self.size, dtype=np.int64)
            self._inverse[table] = np.arange(self.size, dtype=np.int64)
        return self._inverse[indices]

    def _small_table(self) -> Optional[np.ndarray]:
        """The whole order of an epoch below :data:`SMALL_SIZE` samples, computed at its first use.

        A step of a small epoch asks for a handful of positions, and the network's 24 rounds cost
        numpy's per-call overhead whatever their number: one pass over the whole epoch (at most
        4,095 entries, 32 KB) then serves every step by lookup. The same entries, from the same
        network."""
        if self.size >= SMALL_SIZE:
            return None
        if self._table is None:
            self._table = self.network.permute(np.arange(self.size, dtype=np.int64)).astype(np.int64)
        return self._table


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
    """The epoch's order of ``range(size)``, the same on every rank.

    A :class:`FeistelOrder` keyed by ``(seed, epoch)`` with ``shuffle``, an
    :class:`IdentityOrder` without. Building it costs microseconds and no
    memory that depends on ``size``; entries are computed when indexed (a
    shuffle of fewer than ``SMALL_SIZE`` samples computes them all at once).

    Raises:
        PartitionError: ``size`` is negative (or >= 2**63), or ``seed``/``epoch``
            negative (or >= 2**64).
    """
    if size < 0:
        raise PartitionError(f"size ({size}) must be >= 0")
    if seed < 0 or epoch < 0:
        raise PartitionError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
    if not shuffle:
        return IdentityOrder(size)
    return FeistelOrder(size, seed, epoch)


def as_order(order: Union[EpochOrder, np.ndarray]) -> EpochOrder:
    """``order`` itself, or an explicit array wrapped in an :class:`ArrayOrder`."""
    return order if isinstance(order, EpochOrder) else ArrayOrder(order)

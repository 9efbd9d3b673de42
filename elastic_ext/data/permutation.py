"""The epoch's order: a permutation of ``range(size)`` computed per position.

Owns :class:`EpochOrder` and its three kinds (identity, explicit array, and
the keyed Feistel shuffle :class:`FeistelOrder` with its round keys and
mixing function), and :func:`epoch_order`, which picks one for an epoch. An
order is *virtual*: the index at any position is computed when asked for, so
no array of ``size`` entries is built. Cutting the order into global steps
and rank shares is :mod:`elastic_ext.data.partition`'s job, which re-exports
these names.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import numpy as np

from elastic_ext.errors import PartitionError

#: Feistel rounds; each part of a position is rewritten ROUNDS / 2 times.
#: Luby-Rackoff needs 4 rounds for a pseudo-random permutation with ideal
#: round functions; 8 leave a margin for the cheap mixing function below.
ROUNDS = 8
#: Epochs smaller than SMALL_SIZE get SMALL_ROUNDS: their parts take few
#: values (a radix of 2 or 3 for a handful of samples) and cycle walks are
#: frequent, and with 8 rounds the exact distribution of where a position
#: lands is still about 3% off uniform for 5 samples (computed with ideal
#: round functions); the gap shrinks geometrically with rounds. Small epochs
#: are cheap anyway, whatever the rounds.
SMALL_SIZE = 1 << 12
SMALL_ROUNDS = 24

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15      # 2**64 / golden ratio: the splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9        # multipliers of the splitmix64 finaliser
_MIX2 = 0x94D049BB133111EB
_SEED_TAG = 0x656C61737469635F    # b"elastic_": keys differ from other splitmix64 users of the same seed
_U_MIX1, _U_MIX2 = np.uint64(_MIX1), np.uint64(_MIX2)
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_MAX_SIZE = (1 << 63) - 1         # indices are returned as int64


def index_dtype(size: int) -> np.dtype:
    """The narrowest signed integer type that holds ``size`` indices."""
    return np.dtype(np.int32) if size < 2 ** 31 else np.dtype(np.int64)


def _mix64(value: int) -> int:
    """splitmix64's finaliser on a Python int: a bijection of 64-bit words with full avalanche."""
    value = ((value ^ (value >> 30)) * _MIX1) & _M64
    value = ((value ^ (value >> 27)) * _MIX2) & _M64
    return value ^ (value >> 31)


def round_keys(seed: int, epoch: int, rounds: int = ROUNDS) -> Tuple[int, ...]:
    """The 64-bit round keys of epoch ``epoch`` under ``seed``.

    ``(seed, epoch)`` is absorbed into one 64-bit state through the mixing
    bijection, and the keys are that state's splitmix64 stream. Consecutive
    epochs therefore get unrelated keys (no shared structure such as
    ``key + epoch``), and only integer arithmetic is involved: the same keys
    in every process, on every platform, whatever ``PYTHONHASHSEED``.

    Raises:
        PartitionError: ``seed`` or ``epoch`` is outside ``[0, 2**64)``.
    """
    for name, value in (("seed", seed), ("epoch", epoch)):
        if not 0 <= value <= _M64:
            raise PartitionError(f"{name} ({value}) must be in [0, 2**64)")
    state = _mix64(_mix64(seed ^ _SEED_TAG) ^ epoch)
    keys = []
    for _ in range(rounds):
        state = (state + _GOLDEN) & _M64
        keys.append(_mix64(state))
    return tuple(keys)


def _mix_array(values: np.ndarray, scratch: np.ndarray) -> None:
    """``_mix64`` on a uint64 array, in place (``scratch`` has the same shape)."""
    np.right_shift(values, _U30, out=scratch)
    values ^= scratch
    values *= _U_MIX1
    np.right_shift(values, _U27, out=scratch)
    values ^= scratch
    values *= _U_MIX2
    np.right_shift(values, _U31, out=scratch)
    values ^= scratch


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

    Construction: the positions ``[0, size)`` are embedded in a rectangle of
    ``high_radix * low_radix >= size`` cells, ``high_radix = ceil(sqrt(size))`` and
    ``low_radix = ceil(size / high_radix)``, so the rectangle exceeds the epoch by fewer than
    ``sqrt(size)`` cells. A position ``x`` is the pair ``(high, low) = divmod(x, low_radix)``.
    Each of :data:`ROUNDS` rounds (:data:`SMALL_ROUNDS` below :data:`SMALL_SIZE` samples) adds to
    one part a keyed function of the other, modulo that part's radix (alternating, low part first)::

        low  = (low  + F(high ^ key[0])) % low_radix
        high = (high + F(low  ^ key[1])) % high_radix
        ...

    where ``F`` is splitmix64's finaliser (two multiplies, three xor-shifts: a 64-bit bijection with
    full avalanche) and the keys come from :func:`round_keys`. A round moves one part by an amount
    that depends only on the other, unchanged part, so it can be undone: every round, hence the
    whole network, is a bijection of the rectangle (a Feistel network over two mixed radices,
    balanced up to one). A position whose image lands at or beyond ``size`` is encrypted again
    (*cycle walking*) until it lands inside: following the permutation's cycle from a cell inside
    the epoch to the next cell inside is itself a bijection of ``[0, size)``, and the walk always
    ends because the cycle returns to its starting cell. Since the rectangle exceeds the epoch by
    fewer than ``sqrt(size)`` cells, a walk is rare (probability below ``1 / sqrt(size)`` per
    position), so a batch costs one pass of the network, not the several passes a power-of-two
    domain (up to twice the epoch) would need for its slowest position.


    Guarantees: a true permutation for every size (``0`` and ``1`` included, where there is nothing
    to shuffle); the same in every process (integer arithmetic only); time per position independent
    of ``size``; ``O(1)`` state (the round keys). Statistical quality (uniform positions and pairs
    of positions over seeds, unrelated orders from one epoch to the next) is checked by the unit
    tests. Not every one of the ``size!`` orders can come out: there are at most ``2**64`` keys, and
    a round only composes cyclic shifts of rows or columns, which for some radices reaches only even
    permutations of the rectangle; what a shuffle needs is that any position, or pair of positions,
    lands anywhere with equal probability, and that is what is tested. It is a shuffle, not a
    cipher: its keys are not meant to withstand an adversary.
    """

    def __init__(self, size: int, seed: int, epoch: int, rounds: Optional[int] = None) -> None:
        super().__init__(size)
        if rounds is None:
            rounds = ROUNDS if self.size >= SMALL_SIZE else SMALL_ROUNDS
        if rounds < 2 or rounds % 2:
            raise PartitionError(f"rounds ({rounds}) must be an even number >= 2 so both parts are mixed")
        self.seed, self.epoch = int(seed), int(epoch)
        self.keys = round_keys(self.seed, self.epoch, rounds)
        self.high_radix = math.isqrt(self.size - 1) + 1 if self.size else 1
        self.low_radix = -(-self.size // self.high_radix) if self.size else 1
        self._radices = (np.uint64(self.high_radix), np.uint64(self.low_radix))
        self._ukeys = tuple(np.uint64(key) for key in self.keys)

    def __repr__(self) -> str:
        return f"FeistelOrder(size={self.size}, seed={self.seed}, epoch={self.epoch})"

    def encrypt(self, cells: np.ndarray) -> np.ndarray:
        """The Feistel network on cells of the rectangle (uint64 in
        ``[0, high_radix * low_radix)``), without cycle walking."""
        return self._network(cells, inverse=False)

    def decrypt(self, cells: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`encrypt`: the rounds undone in reverse order."""
        return self._network(cells, inverse=True)

    def _network(self, cells: np.ndarray, inverse: bool) -> np.ndarray:
        high_radix, low_radix = self._radices
        high = cells // low_radix
        low = cells - high * low_radix
        mixed = np.empty_like(low)
        scratch = np.empty_like(low)
        rounds = range(len(self._ukeys))
        for round_ in (reversed(rounds) if inverse else rounds):
            source, target, radix = (high, low, low_radix) if round_ % 2 == 0 else (low, high, high_radix)
            if radix == 1:
                continue  # a part with a single value (size 2): nothing to move
            np.bitwise_xor(source, self._ukeys[round_], out=mixed)
            _mix_array(mixed, scratch)
            mixed %= radix
            if inverse:  # unsigned: add the complement instead of subtracting
                np.subtract(radix, mixed, out=mixed)
            target += mixed
            target %= radix
        high *= low_radix
        high += low
        return high

    def _walk(self, values: np.ndarray, network: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Applies ``network`` and walks every value that lands outside the epoch back in."""
        if self.size <= 1:
            return values.copy()
        limit = np.uint64(self.size)
        flat = network(values.reshape(-1).astype(np.uint64))
        pending = np.flatnonzero(flat >= limit)
        while pending.size:
            walked = network(flat[pending])
            flat[pending] = walked
            pending = pending[walked >= limit]
        return flat.reshape(values.shape)

    def _compute(self, positions: np.ndarray) -> np.ndarray:
        return self._walk(positions, self.encrypt)

    def _invert(self, indices: np.ndarray) -> np.ndarray:
        return self._walk(indices, self.decrypt)


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
    """The epoch's order of ``range(size)``, the same on every rank.

    A :class:`FeistelOrder` keyed by ``(seed, epoch)`` with ``shuffle``, an
    :class:`IdentityOrder` without. Building it costs microseconds and no
    memory that depends on ``size``; entries are computed when indexed.

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

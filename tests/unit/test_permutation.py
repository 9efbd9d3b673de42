"""The virtual epoch order: a true permutation, computed per position, statistically a fair shuffle.

Statistical tests use fixed seeds, so they are deterministic; their
thresholds sit 4.5 standard deviations out (chi-square via the
Wilson-Hilferty approximation), where a fair shuffle fails with probability
about 3e-6 per check, while the defects they look for (a position that
favours some samples, two epochs that share structure, neighbours that stay
together) push the statistic far beyond.
"""

import json
import math
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from elastic_ext.data import permutation
from elastic_ext.errors import PartitionError
from elastic_ext.data.sampler import ElasticPartitioner

Z = 4.5
M64 = (1 << 64) - 1


def chi2_limit(df: int, z: float = Z) -> float:
    """Upper ``z``-sigma quantile of a chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, expected: float) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def primes_below(n):
    sieve = np.ones(n, dtype=bool)
    sieve[:2] = False
    for i in range(2, math.isqrt(n) + 1):
        if sieve[i]:
            sieve[i * i::i] = False
    return np.flatnonzero(sieve).tolist()


# ----------------------------------------------------------------- bijection

SIZES = sorted(set(
    list(range(0, 40))
    + primes_below(600)[::7] + [4093, 65521, 1_000_003]
    + [2 ** k + d for k in range(1, 18) for d in (-1, 0, 1)]
    + [k * k + d for k in (45, 63, 64, 255) for d in (-1, 0, 1)]          # rectangle exactly full, or one short
    + [permutation.SMALL_SIZE - 1, permutation.SMALL_SIZE, permutation.SMALL_SIZE + 1]  # where the rounds change
))


def test_order_is_a_permutation_for_many_sizes():
    wrong = []
    for size in SIZES:
        for seed, epoch in ((0, 0), (5, 1), (2 ** 64 - 1, 12345)):
            order = permutation.epoch_order(size, seed, epoch)
            values = order[:]
            if not (len(order) == size and values.shape == (size,)):
                wrong.append(f"size {size}, seed {seed}, epoch {epoch}: length {len(order)}, shape {values.shape}")
            elif not np.array_equal(np.sort(values), np.arange(size)):
                wrong.append(f"size {size}, seed {seed}, epoch {epoch}: not a permutation")
            elif not np.array_equal(order.positions_of(values), np.arange(size)):
                wrong.append(f"size {size}, seed {seed}, epoch {epoch}: the inverse is wrong")
    assert not wrong, "\n".join(wrong)


def test_shuffle_false_is_the_identity():
    for size in (0, 1, 10, 4097):
        order = permutation.epoch_order(size, seed=3, epoch=2, shuffle=False)
        assert np.array_equal(order[:], np.arange(size))
    assert permutation.epoch_order(2 ** 40, 3, 2, shuffle=False)[2 ** 39:2 ** 39 + 3].tolist() == [2 ** 39 + d for d in range(3)]


def test_tiny_orders_shuffle_at_all():
    # Size 2 has two orders; both must come out over seeds (not a fixed identity).
    firsts = {permutation.epoch_order(2, seed, 0)[0] for seed in range(64)}
    assert firsts == {0, 1}


# ------------------------------------------------------- direct computation

def reference_order(order: permutation.FeistelOrder, position: int) -> int:
    """The network of FeistelNetwork's docstring in plain Python integers, cycle walking included."""
    def mix(value):
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & M64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & M64
        return value ^ (value >> 31)

    def network(cell):
        high, low = divmod(cell, order.low_radix)
        for round_, key in enumerate(order.keys):
            if round_ % 2 == 0:
                low = (low + mix(high ^ key) % order.low_radix) % order.low_radix
            else:
                high = (high + mix(low ^ key) % order.high_radix) % order.high_radix
        return high * order.low_radix + low

    if order.size <= 1:
        return position
    value = network(position)
    while value >= order.size:
        value = network(value)
    return value


@pytest.mark.parametrize("size, seed, epoch", [(2, 0, 0), (7, 1, 2), (1000, 3, 4), (4097, 9, 0),
                                               (10 ** 9, 7, 3), (2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64 - 1)])
def test_vectorised_slice_equals_elementwise_and_a_python_reference(size, seed, epoch):
    order = permutation.epoch_order(size, seed, epoch)
    rng = np.random.default_rng(size % 1000)
    positions = np.unique(np.concatenate([np.arange(min(size, 300)), np.arange(max(0, size - 50), size),
                                          rng.integers(0, size, 200, dtype=np.int64)]))
    vectorised = order.take(positions)
    assert vectorised.dtype == permutation.index_dtype(size)
    assert [order[int(p)] for p in positions] == vectorised.tolist()
    assert [reference_order(order, int(p)) for p in positions] == vectorised.tolist()
    # Any shape, any order of positions: the same entries.
    shuffled = rng.permutation(positions)
    two_d = shuffled[: (shuffled.size // 4) * 4].reshape(4, -1)
    assert np.array_equal(order.take(two_d), order.take(two_d.ravel()).reshape(two_d.shape))
    if size < 10 ** 6:
        assert np.array_equal(order[:][positions], vectorised)
        assert np.array_equal(order[3:size - 2:5], order[:][3:size - 2:5])


def test_orders_are_pinned_across_versions():
    # A checkpoint stores only (seed, epoch, cursor): a resumed job must see the
    # same order as the one that wrote it, so the construction may not change
    # silently from one release to the next.
    assert permutation.epoch_order(10, 0, 0)[:].tolist() == [0, 6, 1, 4, 9, 8, 2, 7, 5, 3]
    assert permutation.epoch_order(10, 0, 1)[:].tolist() == [3, 1, 5, 8, 9, 7, 4, 2, 6, 0]
    big = permutation.epoch_order(10 ** 9, 7, 3)
    assert big[:8].tolist() == [712975557, 948271962, 937692831, 474963855, 489669682, 11963897, 263183568,
                                584062240]
    assert big[10 ** 9 - 4:].tolist() == [481075284, 812208885, 907337270, 480706773]
    assert permutation.epoch_order(2 ** 63 - 1, 1, 0)[:4].tolist() == [
        1027565819422974968, 7220734258407608418, 289796750791535172, 1706450315503511412]


CHILD = """
import json, sys
from elastic_ext.data import permutation
out = {}
for size, seed, epoch in json.loads(sys.argv[1]):
    out[f"{size},{seed},{epoch}"] = permutation.epoch_order(size, seed, epoch)[max(0, size - 64):size].tolist()
print(json.dumps(out))
"""


def test_every_process_computes_the_same_order():
    cases = [[10, 0, 0], [4097, 3, 1], [10_000_019, 1, 7], [10 ** 9, 11, 2], [2 ** 62 + 5, 2 ** 63, 9]]
    mine = {f"{s},{seed},{e}": permutation.epoch_order(s, seed, e)[max(0, s - 64):s].tolist()
            for s, seed, e in cases}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for hash_seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == mine


# ------------------------------------------------------------ O(1) in size

@pytest.mark.parametrize("size", [10 ** 9, 2 ** 40 + 3, 2 ** 63 - 1])
def test_a_slice_of_a_huge_epoch_needs_no_memory_of_its_size(size):
    order = permutation.epoch_order(size, seed=1, epoch=4)
    tracemalloc.start()
    try:
        head, tail = order[:1000], order[size - 1000:]
        back = order.positions_of(tail)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"computing 2000 entries of a {size}-sample order peaked at {peak} bytes"
    assert head.dtype == permutation.index_dtype(size)
    both = np.concatenate([head, tail]).astype(np.int64)
    assert ((both >= 0) & (both < size)).all() and np.unique(both).size == 2000
    assert np.array_equal(back, np.arange(size - 1000, size))


def test_a_newcomer_gets_its_first_batch_of_a_billion_sample_epoch_without_building_the_order():
    world = lambda: (3, 8)  # noqa: E731
    survivor = ElasticPartitioner(10 ** 9, batch_size=256, seed=5, policy="pad", world=world)
    survivor.set_epoch(2)
    for _ in range(1000):
        survivor.record_step()
    committed = survivor.state_dict()
    tracemalloc.start()
    try:
        newcomer = ElasticPartitioner(10 ** 9, batch_size=256, seed=5, policy="pad", world=world)
        newcomer.load_state_dict(committed)
        indices, pad = next(newcomer.batches())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"a newcomer's first batch peaked at {peak} bytes"
    positions = committed["cursor"] + 3 * 256 + np.arange(256)
    assert np.array_equal(indices, permutation.epoch_order(10 ** 9, 5, 2).take(positions)) and not pad.any()
    assert np.array_equal(indices, next(survivor.batches())[0])


# ------------------------------------------------------------ shuffle quality

def orders(size, positions, seeds=40, epochs=60):
    """Entries at ``positions`` of every (seed, epoch) order: one row per order."""
    return np.array([permutation.epoch_order(size, seed, epoch).take(positions)
                     for seed in range(seeds) for epoch in range(epochs)], dtype=np.int64)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 10, 17])
def test_every_position_is_uniform_over_seeds_and_epochs_small(size):
    rows = orders(size, np.arange(size))
    count = rows.shape[0]
    # Where each position lands: an n x n table, expected count/n everywhere.
    table = np.stack([np.bincount(rows[:, p], minlength=size) for p in range(size)])
    assert chi2(table, count / size) < chi2_limit(max(1, (size - 1) ** 2)), table
    # Where two positions land together: uniform over the n(n-1) ordered pairs.
    for first, second in ((0, 1), (0, size - 1), (size // 2, size - 1)):
        if first == second:
            continue
        joint = np.bincount(rows[:, first] * size + rows[:, second], minlength=size * size).reshape(size, size)
        assert not np.diag(joint).any()
        cells = joint[~np.eye(size, dtype=bool)]
        assert chi2(cells, count / (size * (size - 1))) < chi2_limit(max(1, cells.size - 1)), joint


@pytest.mark.parametrize("size", [10_000_019, 10 ** 9 + 7])
def test_positions_and_neighbours_are_uniform_at_scale(size):
    order = permutation.epoch_order(size, 0, 0)
    stride = order.low_radix          # the next position with the same low part: one row down the rectangle
    starts = [0, 1, size // 2, size - 2 * stride - 2, 1_234_567]
    positions = np.array(sorted({s + d for s in starts for d in (0, 1, stride)}), dtype=np.int64)
    rows = orders(size, positions, seeds=40, epochs=50)
    bins = 20
    binned = rows * bins // size
    count = rows.shape[0]
    total = sum(chi2(np.bincount(binned[:, p], minlength=bins), count / bins) for p in range(len(positions)))
    assert total < chi2_limit(len(positions) * (bins - 1))
    # Neighbouring positions (next in the epoch, or next row of the rectangle) land independently.
    index = {int(p): i for i, p in enumerate(positions)}
    side = 8
    coarse = rows * side // size
    joint_total, df = 0.0, 0
    for s in starts:
        for d in (1, stride):
            a, b = coarse[:, index[s]], coarse[:, index[s + d]]
            joint_total += chi2(np.bincount(a * side + b, minlength=side * side), count / side ** 2)
            df += side * side - 1
    assert joint_total < chi2_limit(df)


def correlation_z(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation scaled to a standard normal under independence."""
    return float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1] * math.sqrt(a.size - 1))


def test_consecutive_epochs_and_seeds_are_unrelated():
    size, pairs = 100_003, 16
    bins = 32
    positions = np.arange(size)
    z2 = {"epochs": 0.0, "seeds": 0.0, "position": 0.0, "serial": 0.0}
    matches = 0
    difference_chi2 = 0.0
    for k in range(pairs):
        this = permutation.epoch_order(size, 3, k)[:]
        following = permutation.epoch_order(size, 3, k + 1)[:]
        other_seed = permutation.epoch_order(size, 4, k)[:]
        z2["epochs"] += correlation_z(this, following) ** 2
        z2["seeds"] += correlation_z(this, other_seed) ** 2
        z2["position"] += correlation_z(this, positions) ** 2   # no drift of early positions to early samples
        z2["serial"] += correlation_z(this[:-1], this[1:]) ** 2  # neighbours do not stay close
        matches += int((this == following).sum())
        # How far each sample moved from one epoch to the next: uniform, not a fixed shift.
        shift = (following.astype(np.int64) - this) % size
        difference_chi2 += chi2(np.bincount(shift * bins // size, minlength=bins), size / bins)
    for name, value in z2.items():
        assert value < chi2_limit(pairs), f"{name}: sum of squared correlation z-scores {value:.1f}"
    # Samples at the same position in two epochs: Poisson(1) per pair under independence.
    assert matches < pairs + Z * math.sqrt(pairs), matches
    assert difference_chi2 < chi2_limit(pairs * (bins - 1))


def test_the_mixing_catches_a_weak_shuffle():
    # The statistics above must be able to fail: an order that only rotates
    # from one epoch to the next (a fixed pattern) is rejected by the shift test.
    size, bins = 100_003, 32
    base = permutation.epoch_order(size, 3, 0)[:].astype(np.int64)
    rotated = (base + 17) % size
    shift = (rotated - base) % size
    assert chi2(np.bincount(shift * bins // size, minlength=bins), size / bins) > chi2_limit(bins - 1)
    assert correlation_z(np.arange(size), np.arange(size)) ** 2 > chi2_limit(1)


# --------------------------------------------------------------------- errors

def test_errors_quote_the_value_and_the_rule():
    order = permutation.epoch_order(10, 0, 0)
    with pytest.raises(PartitionError, match=r"position \(10\) must be in \[0, 10\)"):
        order.take(np.array([3, 10]))
    with pytest.raises(PartitionError, match=r"position \(-1\) must be in \[0, 10\)"):
        order.take(np.array([-1]))
    with pytest.raises(PartitionError, match=r"index \(12\) must be in \[0, 10\)"):
        order.positions_of(np.array([12]))
    with pytest.raises(PartitionError, match=r"must be integers, got dtype float64"):
        order.take(np.array([1.0]))
    with pytest.raises(IndexError, match=r"position \(10\) out of range"):
        order[10]
    with pytest.raises(PartitionError, match=r"seed \(18446744073709551616\) must be in \[0, 2\*\*64\)"):
        permutation.epoch_order(10, 2 ** 64, 0)
    with pytest.raises(PartitionError, match=r"size \(9223372036854775808\) must be an integer in \[0, 2\*\*63\)"):
        permutation.epoch_order(2 ** 63, 0, 0)
    with pytest.raises(PartitionError, match=r"rounds \(3\) must be an even number >= 2"):
        permutation.FeistelOrder(10, 0, 0, rounds=3)
    assert order[-1] == order[:][-1]

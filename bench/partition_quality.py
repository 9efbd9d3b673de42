"""bench.partition's shuffle-quality checks: the epoch order as a shuffle, old and new side by side.

A virtual order (a keyed Feistel network, elastic_ext.data.partition.FeistelOrder)
replaced a numpy shuffle of the whole index space; these statistics say
whether it still shuffles like one. Each gives a chi-square statistic or a
z-score with its p-value under the hypothesis of a uniform random
permutation, for the new order and, where it can be computed, the old one:

- ``position_uniformity_small``: over many seeds, where each position of a
  small epoch lands (an n x n table of counts, expected equal everywhere);
- ``position_uniformity_at_scale``: over many seeds, where a few fixed
  positions of a 10M or 1B epoch land, in equal bins of the index space (new
  order only: the old one would need a full shuffle per seed);
- ``between_epochs``: for a random sample of indices, the correlation of
  their positions in consecutive epochs (z = r * sqrt(n - 1), standard
  normal when unrelated), and how many keep their position.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import numpy as np
from scipy import stats

from elastic_ext.data import partition

OrderFn = Callable[[int, int, int], np.ndarray]  # (size, seed, epoch) -> whole order


def chi_square(counts: np.ndarray, expected: float) -> Dict[str, float]:
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.size - 1
    return {"chi2": statistic, "dof": dof, "p_value": float(stats.chi2.sf(statistic, dof))}


def position_uniformity_small(order_fn: OrderFn, size: int, seeds: int) -> Dict[str, Any]:
    """Counts of (position, index) over ``seeds`` orders of ``size`` samples (epoch 0)."""
    table = np.zeros((size, size), dtype=np.int64)
    positions = np.arange(size)
    for seed in range(seeds):
        table[positions, order_fn(size, seed, 0)] += 1
    out = chi_square(table, seeds / size)
    out["dof"] = (size - 1) ** 2  # rows and columns each sum to a constant
    out["p_value"] = float(stats.chi2.sf(out["chi2"], out["dof"]))
    return dict(out, size=size, seeds=seeds)


def position_uniformity_at_scale(size: int, seeds: int, bins: int = 50, positions: int = 16) -> Dict[str, Any]:
    """Where ``positions`` spread-out positions of the new order land over ``seeds`` seeds, in ``bins`` bins."""
    where = np.linspace(0, size - 1, positions).astype(np.int64)
    landed = np.array([partition.epoch_order(size, seed, 0).take(where) for seed in range(seeds)], dtype=np.int64)
    binned = landed * bins // size
    total = sum(chi_square(np.bincount(binned[:, p], minlength=bins), seeds / bins)["chi2"]
                for p in range(positions))
    dof = positions * (bins - 1)
    return {"size": size, "seeds": seeds, "bins": bins, "positions": positions, "chi2": total, "dof": dof,
            "p_value": float(stats.chi2.sf(total, dof))}


def between_epochs(positions_of: Callable[[int], np.ndarray], size: int, epochs: int, sample: int
                   ) -> Dict[str, Any]:
    """Correlation of the positions of ``sample`` indices between consecutive epochs.

    ``positions_of(epoch)`` returns the sampled indices' positions in that epoch.
    """
    rows: List[Dict[str, Any]] = []
    previous = positions_of(0).astype(np.float64)
    for epoch in range(1, epochs):
        current = positions_of(epoch).astype(np.float64)
        r = float(np.corrcoef(previous, current)[0, 1])
        z = r * math.sqrt(previous.size - 1)
        rows.append({"epochs": [epoch - 1, epoch], "pearson_r": r, "z": z,
                     "p_value": float(2 * stats.norm.sf(abs(z))),
                     "same_position": int((previous == current).sum())})
        previous = current
    z2 = sum(row["z"] ** 2 for row in rows)  # chi-square with one dof per pair under independence
    return {"size": size, "sample": sample, "pairs": rows, "max_abs_z": max(abs(row["z"]) for row in rows),
            "sum_z2": z2, "p_value": float(stats.chi2.sf(z2, len(rows))),
            "expected_same_position": sample / size * len(rows)}


def feistel_positions(size: int, sample: np.ndarray, seed: int) -> Callable[[int], np.ndarray]:
    return lambda epoch: partition.epoch_order(size, seed, epoch).positions_of(sample)


def materialised_positions(order_fn: OrderFn, size: int, sample: np.ndarray, seed: int
                           ) -> Callable[[int], np.ndarray]:
    def positions(epoch: int) -> np.ndarray:
        inverse = np.empty(size, dtype=np.int64)
        inverse[order_fn(size, seed, epoch)] = np.arange(size)
        return inverse[sample]
    return positions


def check(old_order: OrderFn, sizes: List[int], old_max_size: int, small_size: int = 64,
          small_seeds: int = 6400, scale_seeds: int = 2000, epochs: int = 5, sample: int = 100_000,
          seed: int = 0) -> Dict[str, Any]:
    """Every statistic above; the old order wherever its size is at most ``old_max_size``."""
    new_order: OrderFn = lambda n, s, e: partition.epoch_order(n, s, e)[:]  # noqa: E731
    out: Dict[str, Any] = {
        "position_uniformity_small": {"new": position_uniformity_small(new_order, small_size, small_seeds),
                                      "old": position_uniformity_small(old_order, small_size, small_seeds)},
        "position_uniformity_at_scale": {"new": [position_uniformity_at_scale(n, scale_seeds) for n in sizes]},
        "between_epochs": {"new": [], "old": []},
    }
    rng = np.random.default_rng(seed + 12345)
    for size in sizes:
        picked = rng.choice(size, size=min(sample, size), replace=False)
        out["between_epochs"]["new"].append(between_epochs(feistel_positions(size, picked, seed), size, epochs,
                                                           picked.size))
        if size <= old_max_size:
            out["between_epochs"]["old"].append(between_epochs(
                materialised_positions(old_order, size, picked, seed), size, min(epochs, 3), picked.size))
    return out


def summary_lines(quality: Dict[str, Any]) -> List[str]:
    """One line per statistic: the new order's p-value next to the old one's."""
    small = quality["position_uniformity_small"]
    lines = [f"position uniformity, {small['new']['size']} samples over {small['new']['seeds']} seeds: chi2 p "
             f"new {small['new']['p_value']:.3f}, old {small['old']['p_value']:.3f}"]
    for item in quality["position_uniformity_at_scale"]["new"]:
        lines.append(f"position uniformity at {item['size']:,} samples ({item['positions']} positions x "
                     f"{item['seeds']} seeds, {item['bins']} bins): chi2 p new {item['p_value']:.3f}")
    old = {item["size"]: item for item in quality["between_epochs"]["old"]}
    for item in quality["between_epochs"]["new"]:
        text = (f"consecutive epochs at {item['size']:,} samples ({item['sample']:,} indices): max |z| new "
                f"{item['max_abs_z']:.2f} (p {item['p_value']:.3f})")
        if item["size"] in old:
            text += f", old {old[item['size']]['max_abs_z']:.2f} (p {old[item['size']]['p_value']:.3f})"
        lines.append(text)
    return lines

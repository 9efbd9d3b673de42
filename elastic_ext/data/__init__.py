"""Deterministic data: the keyed epoch permutation, re-partitioning at any world size, the
framework-free elastic sampler (worker; pure, no collective of its own).
"""

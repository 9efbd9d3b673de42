"""The 8x8 handwritten digits the examples, tests and benchmarks train on, read from ``digits.npz`` beside this file.

Origin: these are the test images of the UCI repository's "Optical
Recognition of Handwritten Digits" data set (E. Alpaydin and C. Kaynak,
licensed CC BY 4.0), copied once from the version scikit-learn distributes
(``sklearn.datasets.load_digits``). The file holds 1797 images of 64 pixels,
each pixel a count from 0 to 16 stored as uint8, and their labels 0 to 9.
Reading it costs a worker start milliseconds; importing that library cost
about 1.7 s.

``load_digits()`` returns the same arrays as the original loader (``data``
float64, ``target`` int64), so a script switches by changing its import only.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")
IMAGES = 1797
PIXELS = 64
MAX_PIXEL = 16
CLASSES = 10


class Digits(NamedTuple):
    data: np.ndarray    # (1797, 64) float64, values 0..16
    target: np.ndarray  # (1797,) int64, values 0..9


def _check(path: str, name: str, array: np.ndarray, shape: tuple, high: int) -> None:
    if array.shape != shape or array.dtype.kind not in "ui":
        raise ValueError(f"{path}: '{name}' is {array.dtype} {array.shape}, expected integers of shape {shape}")
    if array.size and (array.min() < 0 or array.max() > high):
        raise ValueError(f"{path}: '{name}' holds values {array.min()}..{array.max()}, expected 0..{high}")


def load_digits(path: str = PATH) -> Digits:
    """Reads the digits from ``path`` (default: the shipped ``digits.npz``).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file lacks ``data`` or ``target``, or their shape,
            dtype or value range is not what is described above.
    """
    with np.load(path) as npz:
        missing = [key for key in ("data", "target") if key not in npz.files]
        if missing:
            raise ValueError(f"{path}: no {missing} array, expected 'data' and 'target' (found {npz.files})")
        data, target = npz["data"], npz["target"]
    _check(path, "data", data, (IMAGES, PIXELS), MAX_PIXEL)
    _check(path, "target", target, (IMAGES,), CLASSES - 1)
    return Digits(data=data.astype(np.float64), target=target.astype(np.int64))

"""examples/digits.py: the shipped digits and the checks made when they are read."""

import numpy as np
import pytest

from examples.digits import IMAGES, PIXELS, load_digits


def test_the_shipped_file_gives_the_arrays_the_scripts_expect():
    digits = load_digits()
    assert digits.data.dtype == np.float64 and digits.data.shape == (IMAGES, PIXELS)
    assert digits.target.dtype == np.int64 and digits.target.shape == (IMAGES,)
    assert (digits.data.min(), digits.data.max()) == (0.0, 16.0)
    assert np.array_equal(np.bincount(digits.target), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])


def _write(path, **arrays):
    np.savez_compressed(path, **arrays)
    return str(path)


@pytest.mark.parametrize("arrays, message", [
    ({"data": np.zeros((IMAGES, PIXELS), np.uint8)}, "no ['target'] array"),
    ({"data": np.zeros((10, PIXELS), np.uint8), "target": np.zeros(IMAGES, np.uint8)},
     "'data' is uint8 (10, 64), expected integers of shape (1797, 64)"),
    ({"data": np.zeros((IMAGES, PIXELS), np.float32), "target": np.zeros(IMAGES, np.uint8)},
     "'data' is float32 (1797, 64), expected integers"),
    ({"data": np.full((IMAGES, PIXELS), 17, np.uint8), "target": np.zeros(IMAGES, np.uint8)},
     "'data' holds values 17..17, expected 0..16"),
    ({"data": np.zeros((IMAGES, PIXELS), np.uint8), "target": np.full(IMAGES, 10, np.int64)},
     "'target' holds values 10..10, expected 0..9"),
])
def test_a_wrong_file_is_named_with_what_was_expected(tmp_path, arrays, message):
    path = _write(tmp_path / "digits.npz", **arrays)
    with pytest.raises(ValueError) as raised:
        load_digits(path)
    assert str(raised.value).startswith(path + ": ") and message in str(raised.value)

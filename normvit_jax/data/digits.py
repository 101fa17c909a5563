"""The offline demo set: scikit-learn's bundled 8x8 handwritten digits (no network, no tfds).

1,797 grayscale images with values 0..16 and 10 classes. The split is fixed and stratified without
any random generator (so it cannot drift with a library version): within each class, in the order
scikit-learn ships them, every 5th image (class ranks 4, 9, 14, ...) is a test image.

    train: 1,442 images, per class [143, 146, 142, 147, 145, 146, 145, 144, 140, 144]
    test:    355 images, per class [ 35,  36,  35,  36,  36,  36,  36,  35,  34,  36]

Images are returned in [0, 1] (value / 16) as float32 (N, 8, 8, 3), the gray value in all three
channels. Split names: 'train', and 'test' (alias 'validation').
"""
from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

NUM_TRAIN, NUM_TEST = 1442, 355


def _bundled_csv() -> str | None:
    """scikit-learn's ``datasets/data/digits.csv.gz``, found without importing scikit-learn (its
    import costs ~2 s of CPU, paid by every training process of the demo and the tests)."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            return path
    return None


def _raw() -> tuple[np.ndarray, np.ndarray]:
    """(values 0..16 (N, 8, 8), labels (N,)) as ``sklearn.datasets.load_digits`` reads them: one
    row per image, 64 pixel values then the label."""
    path = _bundled_csv()
    if path is None:  # another scikit-learn layout: its own loader
        from sklearn.datasets import load_digits
        d = load_digits()
        return d.images, d.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1]


@functools.lru_cache(maxsize=None)
def _load_all() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    images, target = _raw()
    y = target.astype(np.int32)
    x = np.repeat((images / 16.0).astype(np.float32)[..., None], 3, axis=-1)
    test = np.zeros(len(y), bool)
    for c in range(10):
        test[np.flatnonzero(y == c)[4::5]] = True
    for a in (x, y, test):
        a.setflags(write=False)  # cached and shared: nobody may modify it
    return x, y, test


def load(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 (N, 8, 8, 3) in [0, 1], labels int32 (N,)) of 'train' or 'test'."""
    x, y, test = _load_all()
    if split == "train":
        keep = ~test
    elif split in ("test", "validation"):
        keep = test
    else:
        raise ValueError(f"digits has splits 'train' and 'test' (alias 'validation'), "
                         f"got {split!r}")
    return x[keep], y[keep]

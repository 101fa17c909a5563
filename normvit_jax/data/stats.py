"""Per-channel training-set statistics in [0, 1] pixel units, and the value-range mapping.

The model side may fold these into the patch kernel (feature normalization is affine per channel),
so they are exposed as plain numbers. CIFAR values are the population mean/std over all pixels of
the 50,000 training images (not the often-quoted mean of per-image stds); ImageNet values are the
usual torchvision constants. Digits statistics are computed once from the fixed training split.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

NORMALIZE = ("minus_one_one", "zero_one", "zscore", "minmax", "imagenet")
# timm's IMAGENET_DEFAULT_MEAN / _STD (timm/data/constants.py): what DeiT, timm and the methods'
# original code feed their ViTs on any dataset; 'imagenet' uses them whatever data.name is, so a
# model trained there evaluates and fine-tunes on the inputs it learned on.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_KNOWN = {
    "cifar10": dict(mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": dict(mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
    "imagenet2012": dict(mean=IMAGENET_MEAN, std=IMAGENET_STD),
}


@functools.lru_cache(maxsize=None)
def dataset_stats_tuple(name: str) -> tuple[tuple[float, float, float], ...]:
    """(mean, std, min, max) of a built-in dataset's training set, each a tuple of 3 floats."""
    if name != "digits" and name not in _KNOWN:
        raise ValueError(f"config.data.name={name!r} is not a known dataset; accepted: "
                         f"{sorted(['digits', *_KNOWN])}")
    if name == "digits":
        from normvit_jax.data import digits
        x = digits.load("train")[0].astype(np.float64)  # float32 sums drift in the 4th digit
        axes = (0, 1, 2)
        return (tuple(x.mean(axes).tolist()), tuple(x.std(axes).tolist()),
                tuple(x.min(axes).tolist()), tuple(x.max(axes).tolist()))
    k = _KNOWN[name]
    # Every channel of these natural-image sets reaches both 0 and 255 somewhere in training.
    return k["mean"], k["std"], (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)


def dataset_stats(name: str) -> dict[str, np.ndarray]:
    """Per-channel ``mean``, ``std``, ``min``, ``max`` of the training set: float32 (3,) each,
    in [0, 1] pixel units (so ``(x01 - mean) / std`` is the zscore input)."""
    mean, std, lo, hi = dataset_stats_tuple(name)
    f = lambda v: np.asarray(v, np.float32)  # noqa: E731
    return dict(mean=f(mean), std=f(std), min=f(lo), max=f(hi))


def affine(name: str, normalize: str) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) of a built-in dataset (``affine_of`` its ``dataset_stats``)."""
    return affine_of(dataset_stats(name), normalize)


def affine_of(s: dict[str, np.ndarray], normalize: str) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift), float32 (3,), such that model input = x01 * scale + shift, from the
    training statistics ``s`` (``mean``, ``std``, ``min``, ``max``; only zscore/minmax use them;
    imagenet: ``(x01 - IMAGENET_MEAN) / IMAGENET_STD`` whatever ``s`` is)."""
    if normalize not in NORMALIZE:
        raise ValueError(f"config.data.normalize={normalize!r} is invalid; accepted: "
                         f"{list(NORMALIZE)}")
    one = np.ones(3, np.float32)
    if normalize == "zero_one":
        return one, 0 * one
    if normalize == "minus_one_one":
        return 2 * one, -one
    if normalize == "imagenet":
        s = dict(mean=np.asarray(IMAGENET_MEAN, np.float32), std=np.asarray(IMAGENET_STD, np.float32))
    s = {k: np.asarray(v, np.float32) for k, v in s.items()}
    if normalize in ("zscore", "imagenet"):
        return 1 / s["std"], -s["mean"] / s["std"]
    span = np.maximum(s["max"] - s["min"], 1e-6)  # minmax: training min..max -> 0..1
    return 1 / span, -s["min"] / span


def normalization_mean(s: dict[str, np.ndarray], normalize: str) -> np.ndarray:
    """float64 (3,): the [0, 1] pixel that ``normalize`` maps to 0, i.e. the mean of the
    equivalent ``(x01 - mean) / std`` (torchvision's Normalize, whose mean timm's RandAugment
    fills with): the training mean for zscore, ImageNet's for imagenet, 0.5 for minus_one_one,
    the training min for minmax, 0 for zero_one."""
    if normalize not in NORMALIZE:
        raise ValueError(f"config.data.normalize={normalize!r} is invalid; accepted: "
                         f"{list(NORMALIZE)}")
    pick = {"zscore": lambda: s["mean"], "minmax": lambda: s["min"],
            "imagenet": lambda: IMAGENET_MEAN,
            "minus_one_one": lambda: np.full(3, 0.5), "zero_one": lambda: np.zeros(3)}
    return np.asarray(pick[normalize](), np.float64)


def model_input(images: Any, affine: tuple[np.ndarray, np.ndarray] | None) -> Any:
    """Batch images -> model input. uint8 pixels (what JPEG sources ship: a quarter of float32's
    host work and host-to-device bytes) become ``x / 255 * scale + shift`` in float32, on whatever
    array type they are (jax inside a step, numpy outside); float images already are model input.
    ``affine``: ``DataSpec.affine``, required for uint8 images."""
    if images.dtype != np.uint8:
        return images
    if affine is None:
        raise ValueError("uint8 images need the (scale, shift) of config.data.normalize to become "
                         "model input; pass the run's DataSpec.affine")
    scale, shift = (np.asarray(a, np.float32) for a in affine)
    return images.astype(np.float32) / np.float32(255.0) * scale + shift

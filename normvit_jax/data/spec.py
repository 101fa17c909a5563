"""What the data package accepts: dataset names, value ranges, and the checks on ``config.data``.

Everything here is pure: ``validate`` never touches the disk or the network, so a bad config fails
before any dataset is opened or anything is compiled.
"""
from __future__ import annotations

import numbers
from typing import Any

from normvit_jax.data import transforms

NUM_CLASSES: dict[str, int] = {"digits": 10, "cifar10": 10, "cifar100": 100, "imagenet2012": 1000}
NORMALIZE = ("minus_one_one", "zero_one", "zscore", "minmax")
# tfds datasets small enough to hold a split in host memory; the rest are read by random access.
IN_MEMORY_TFDS = ("cifar10", "cifar100")
RANDOM_ACCESS_TFDS = ("imagenet2012", "imagenet_v2", "imagenet2012_real")
# Evaluation-only datasets (config.data.eval_name) and the training set whose labels they share.
EVAL_ONLY_TFDS = {"imagenet_v2": "imagenet2012", "imagenet2012_real": "imagenet2012"}


def num_classes(name: str) -> int:
    """Number of labels of a dataset; raises ValueError naming the accepted datasets."""
    if name not in NUM_CLASSES:
        raise ValueError(f"config.data.name={name!r} is not a known dataset; accepted: "
                         f"{sorted(NUM_CLASSES)}")
    return NUM_CLASSES[name]


def _get(c: Any, key: str, default: Any = None) -> Any:
    return c.get(key, default) if hasattr(c, "get") else getattr(c, key, default)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _fail(key: str, value: Any, accepted: str) -> None:
    raise ValueError(f"config.{key}={value!r} is invalid; accepted: {accepted}")


def validate(config: Any) -> None:
    """Checks ``config.data`` (and the batch sizes and seed the pipeline uses).

    Raises ValueError naming the key, its value and what is accepted. Reads nothing from disk.
    """
    d = config.data
    num_classes(_get(d, "name"))
    if _get(d, "normalize") not in NORMALIZE:
        _fail("data.normalize", _get(d, "normalize"), str(list(NORMALIZE)))
    for key in ("image_size",):
        v = _get(d, key)
        if not _is_int(v) or v < 1:
            _fail(f"data.{key}", v, "an integer >= 1")
    for key in ("crop_padding", "prefetch"):
        v = _get(d, key, 0)
        if not _is_int(v) or v < 0:
            _fail(f"data.{key}", v, "an integer >= 0")
    r = _get(d, "repeated_aug", 1)
    if not _is_int(r) or r < 1:
        _fail("data.repeated_aug", r, "an integer >= 1 (1: off)")
    for key in ("num_train_examples", "num_eval_examples", "num_workers"):
        v = _get(d, key)
        if v is not None and (not _is_int(v) or v < 1):
            _fail(f"data.{key}", v, "None or an integer >= 1")
    for key in ("min_crop_area", "eval_crop_fraction"):
        v = _get(d, key, 1.0)
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0.0 < v <= 1.0:
            _fail(f"data.{key}", v, "a number in (0, 1]")
    for key in ("flip", "random_resized_crop", "return_index", "antialias"):
        v = _get(d, key, False)
        if not isinstance(v, bool):
            _fail(f"data.{key}", v, "True or False")
    interp = _get(d, "interpolation", "bilinear")
    if interp not in transforms.INTERPOLATIONS:
        _fail("data.interpolation", interp, f"one of {list(transforms.INTERPOLATIONS)}")
    for key in ("train_split", "eval_split"):
        v = _get(d, key, "x")
        if not isinstance(v, str) or not v:
            _fail(f"data.{key}", v, "a non-empty tfds split string such as 'train' or 'test[:50%]'")
    en = _get(d, "eval_name")
    if en is not None and en != _get(d, "name") and EVAL_ONLY_TFDS.get(en) != _get(d, "name"):
        _fail("data.eval_name", en, f"None, {_get(d, 'name')!r}, or for imagenet2012: "
              f"{sorted(EVAL_ONLY_TFDS)}")
    dd = _get(d, "data_dir")
    if dd is not None and not isinstance(dd, str):
        _fail("data.data_dir", dd, "None or a path string")
    for key in ("batch_size", "eval_batch_size"):
        v = _get(config, key)
        if not _is_int(v) or v < 1:
            _fail(key, v, "an integer >= 1")
    if not _is_int(_get(config, "seed", 0)):
        _fail("seed", _get(config, "seed"), "an integer")

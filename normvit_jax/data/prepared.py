"""Datasets written by ``python -m normvit_jax.data.prepare``: where they are and what they hold.

A prepared dataset is a standard tfds dataset (``<data_dir>/<name>/1.0.0``: array_record shards,
``dataset_info.json``, ``features.json`` with the class names), plus ``prepare.json`` beside them:
classes, examples per split and class, image sizes, skipped files, the eval split, and the train
split's per-channel statistics. ``prepare.json`` is written last, just before the folder is
renamed into place, so its presence marks a complete dataset.
"""
from __future__ import annotations

import os
import re
from typing import Any

from etils import epath

from normvit_jax import logs, run_config
from normvit_jax.data.errors import DatasetNotFoundError

VERSION = "1.0.0"
INFO_FILE = "prepare.json"


def default_data_dir() -> str:
    """tfds's default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"),
                                                           "tensorflow_datasets")


def version_dir(name: str, data_dir: str | None) -> str:
    return os.path.join(data_dir or default_data_dir(), name, VERSION)


def is_prepared(name: str, data_dir: str | None) -> bool:
    """True if ``name`` was prepared completely in ``data_dir`` (no tfds import, no network;
    local or gs:// paths)."""
    return (epath.Path(version_dir(name, data_dir)) / INFO_FILE).exists()


def list_prepared(data_dir: str | None) -> list[str]:
    """The names of the datasets prepared completely in ``data_dir``, sorted; [] if it cannot be
    listed (a refusal names them: a misspelt name is then one the user sees)."""
    try:
        root = epath.Path(data_dir or default_data_dir())
        return sorted(p.name for p in root.iterdir() if is_prepared(p.name, str(root)))
    except (OSError, ValueError):  # no such folder, no permission, an object store refusing
        return []


def describe(name: str, data_dir: str | None) -> dict[str, Any]:
    """The ``prepare.json`` of a prepared dataset: 'classes' (list of names, label order),
    'splits' ({split: {'examples', 'per_class', 'skipped', 'min_size', 'max_size'}}),
    'eval_split', 'stats' ({'mean', 'std', 'min', 'max'}: per channel, [0, 1] units, train),
    'format', 'source', 'held_out'. Raises FileNotFoundError if it is not prepared."""
    path = epath.Path(version_dir(name, data_dir)) / INFO_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"dataset {name!r} is not prepared in {data_dir or default_data_dir()} (no {path}); "
            f"prepare it with `python -m normvit_jax.data.prepare --src=YOUR_DATA --name={name} "
            f"--data_dir={data_dir or default_data_dir()}`")
    return run_config.read_json(path, f"prepare the dataset again: python -m normvit_jax.data."
                                      f"prepare --src=YOUR_DATA --name={name} --data_dir="
                                      f"{data_dir or default_data_dir()} --overwrite")


def _base_splits(split: str) -> list[str]:
    """'train[:90%]+val' -> ['train', 'val']."""
    return [re.sub(r"\[.*\]$", "", p.strip()) for p in split.split("+")]


def resolve(name: str, data_dir: str | None, train_split: str | None, eval_split: str | None
            ) -> dict[str, Any]:
    """What a run needs of a prepared dataset (reads prepare.json only): 'num_classes',
    'class_names', 'mean'/'std'/'min'/'max' (tuples), 'train_split', 'eval_split'. The configured
    eval split 'test' (the default) means the dataset's own eval split when it has no 'test'; a
    split given as None is not used, and not checked (an evaluation-only set has no train split).
    Raises DatasetNotFoundError (not prepared) or ValueError (a split it does not have)."""
    try:
        info = describe(name, data_dir)
    except FileNotFoundError as e:
        raise DatasetNotFoundError(
            f"config.data.name={name!r} is neither a built-in dataset (digits, cifar10, cifar100, "
            f"imagenet2012) nor prepared: {e}") from None
    have = sorted(info["splits"])
    if eval_split == "test" and "test" not in have:
        if not info.get("eval_split"):
            raise ValueError(f"dataset {name!r} has only the splits {have}; set "
                             f"config.data.eval_split (e.g. 'train[-10%:]' with "
                             f"config.data.train_split='train[:-10%]')")
        eval_split = info["eval_split"]
    for key, split in (("train_split", train_split), ("eval_split", eval_split)):
        if split is None:
            continue
        missing = [b for b in _base_splits(split) if b not in have]
        if missing:
            raise ValueError(f"config.data.{key}={split!r} names {missing[0]!r}, which dataset "
                             f"{name!r} does not have; accepted: {have} (tfds split strings such "
                             f"as 'train[:90%]')")
    st = info["stats"]
    return dict(num_classes=len(info["classes"]), class_names=tuple(info["classes"]),
                mean=tuple(st["mean"]), std=tuple(st["std"]), min=tuple(st["min"]),
                max=tuple(st["max"]), train_split=train_split, eval_split=eval_split)


def builder(name: str, data_dir: str | None) -> Any:
    """The dataset's tfds builder, read from its folder (``tfds.builder_from_directory``)."""
    logs.import_tensorflow_once()
    import tensorflow_datasets as tfds
    if not is_prepared(name, data_dir):
        describe(name, data_dir)  # raises with what to do
    return tfds.builder_from_directory(version_dir(name, data_dir))

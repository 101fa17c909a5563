"""Datasets written by ``python -m normvit_jax.data.prepare``: where they are and what they hold.

A prepared dataset is a standard tfds dataset (``<data_dir>/<name>/1.0.0``: array_record shards,
``dataset_info.json``, ``features.json`` with the class names), plus ``prepare.json`` beside them:
classes, examples per split and class, image sizes, skipped files, the eval split, and the train
split's per-channel statistics. ``prepare.json`` is written last, just before the folder is
renamed into place, so its presence marks a complete dataset.
"""
from __future__ import annotations

import json
import os
from typing import Any

VERSION = "1.0.0"
INFO_FILE = "prepare.json"


def default_data_dir() -> str:
    """tfds's default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(os.path.expanduser("~"),
                                                           "tensorflow_datasets")


def version_dir(name: str, data_dir: str | None) -> str:
    return os.path.join(data_dir or default_data_dir(), name, VERSION)


def is_prepared(name: str, data_dir: str | None) -> bool:
    """True if ``name`` was prepared completely in ``data_dir`` (no tfds import, no network)."""
    return os.path.isfile(os.path.join(version_dir(name, data_dir), INFO_FILE))


def describe(name: str, data_dir: str | None) -> dict[str, Any]:
    """The ``prepare.json`` of a prepared dataset: 'classes' (list of names, label order),
    'splits' ({split: {'examples', 'per_class', 'skipped', 'min_size', 'max_size'}}),
    'eval_split', 'stats' ({'mean', 'std', 'min', 'max'}: per channel, [0, 1] units, train),
    'format', 'source', 'held_out'. Raises FileNotFoundError if it is not prepared."""
    path = os.path.join(version_dir(name, data_dir), INFO_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"dataset {name!r} is not prepared in {data_dir or default_data_dir()} (no {path}); "
            f"prepare it with `python -m normvit_jax.data.prepare --src=YOUR_DATA --name={name} "
            f"--data_dir={data_dir or default_data_dir()}`")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def builder(name: str, data_dir: str | None) -> Any:
    """The dataset's tfds builder, read from its folder (``tfds.builder_from_directory``)."""
    import tensorflow_datasets as tfds
    describe(name, data_dir)  # a clear error first if it is missing or incomplete
    return tfds.builder_from_directory(version_dir(name, data_dir))

"""``make_pipeline``: the host-local batches of one split, for training or evaluation.

Batches are numpy dicts: 'image' (local_B, S, S, 3), float32 in the configured value range for
in-memory sources (digits, CIFAR) or uint8 pixels for encoded sources (ImageNet, prepared datasets;
decoded once into memory when they fit ``data.in_memory_mb``, see ``decoded``; the steps map them
with ``stats.model_input``), 'label' int32 (local_B,); eval batches add 'mask' float32 (1 real,
0 padding) and, with ``config.data.return_index``, every batch carries 'index' int32 (position
in the split, -1 for padding). Order, sharding and resume rules: see ``order``. Each batch is a
pure function of (config, split, step, process_index, process_count).
"""
from __future__ import annotations

import itertools
import math
import os
from typing import Any

import numpy as np
from absl import logging

from normvit_jax.data import (dataspec, decoded, digits, errors, order, prepared, tfds_source,
                              transforms)
from normvit_jax.data import real as real_labels
from normvit_jax.data.prefetch import Prefetcher, ordered_map
from normvit_jax.data.dataspec import setting
from normvit_jax.data.sources import ArraySource, Geometry, JpegSource

Batch = dict[str, np.ndarray]


def _open_source(data_dir: str | None, name: str, tfds_split: str, limit: int | None,
                 workers: int, key: str = "data.train_split"):
    """The source of split ``tfds_split`` (the value of ``config.<key>``) of dataset ``name``; a
    split string tfds cannot read is refused in one line naming ``key``."""
    try:
        src = _open_split(data_dir, name, tfds_split, workers)
    except errors.DatasetNotFoundError:
        raise
    # tfds: unknown split, bad slice (some messages span lines), empty; a slice of 'all' is its
    # NotImplementedError
    except (ValueError, NotImplementedError) as e:
        if str(e).startswith("config."):  # already names its key (a prepared dataset's splits)
            raise
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        if "__len__" in why:  # a slice that ends before it starts, e.g. 'train[5:3]'
            why = "the slice selects no examples"
        raise ValueError(f"config.{key}={tfds_split!r} cannot be read from {name}: {why}") from None
    if limit is not None:  # use the first `limit` examples of the split
        if limit > len(src):
            raise ValueError(f"config.data.num_*_examples={limit} exceeds the {len(src)} "
                             f"examples of {name}:{tfds_split}")
        if isinstance(src, ArraySource):
            src = ArraySource(src.images[:limit], src.labels[:limit])
        else:
            src.n = limit
    return src


def _open_split(data_dir: str | None, name: str, tfds_split: str, workers: int) -> Any:
    if name == "digits":
        src: Any = ArraySource(*digits.load(tfds_split))
    elif name in dataspec.IN_MEMORY_TFDS:
        b = tfds_source.open_builder(name, data_dir, random_access=False)
        src = ArraySource(*tfds_source.load_arrays(b, tfds_split, workers))
    else:  # ImageNet and the datasets of data.prepare: encoded images, read by index
        b = (tfds_source.open_builder(name, data_dir, random_access=True)
             if name in dataspec.NUM_CLASSES or name in dataspec.EVAL_ONLY_TFDS
             else prepared.builder(name, data_dir))
        recs = tfds_source.open_random_access(b, tfds_split)
        examples = None
        if name == "imagenet2012_real":  # its labels are sets, read by RealRecords
            recs = real_labels.RealRecords(recs)
        else:
            examples = tfds_source.serialized_examples(recs)
        src = JpegSource(recs, len(recs), workers, examples, where=f"{name}:{tfds_split}")
    return src


def usable_cores() -> list[int]:
    """The CPUs this process may run on (its affinity: SLURM/cgroups may give it fewer than the
    machine has), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_num_workers() -> int:
    """``config.data.num_workers`` when None: one decode thread per usable core, at most 32."""
    return min(32, len(usable_cores()))


class Pipeline:
    """Host-local batches of one split. Build with ``make_pipeline``."""

    def __init__(self, config: Any, spec: dataspec.DataSpec, split: str, source: Any,
                 process_index: int, process_count: int):
        d = config.data
        self.spec, self.split, self.source, self.seed = spec, split, source, int(config.seed)
        self.num_examples = len(source)
        if self.num_examples < 1:
            name = spec.name if split == "train" else spec.eval_name
            raise ValueError(f"{name}: split for {split!r} has no examples")
        self.global_batch_size = int(config.batch_size if split == "train"
                                     else config.eval_batch_size)
        self.lo, self.hi = order.host_rows(self.global_batch_size, process_index, process_count)
        self.local_batch_size = self.hi - self.lo
        self.process_index, self.process_count = process_index, process_count
        n, b = self.num_examples, self.global_batch_size
        self.steps_per_epoch = n // b if split == "train" else math.ceil(n / b)
        if self.steps_per_epoch < 1:
            raise ValueError(f"config.batch_size={b} is larger than the train split "
                             f"({spec.name}:{d.train_split}, {n} examples): not one step per "
                             f"epoch; accepted: at most {n}")
        self.image_shape = spec.image_shape
        size = spec.image_shape[0]
        # random_resized_crop replaces pad-and-crop (the crop already shifts and scales)
        padding = 0 if d.random_resized_crop else int(d.crop_padding)
        self.prefetch = int(d.prefetch)
        self.return_index = bool(setting(d, "return_index"))
        aa, interp = bool(setting(d, "antialias")), str(setting(d, "interpolation"))
        self._train_geo = Geometry(size, bool(d.random_resized_crop), float(d.min_crop_area), 1.0,
                                   padding, bool(d.flip), aa, interp)
        self._eval_geo = Geometry(size, False, 1.0, float(d.eval_crop_fraction), antialias=aa,
                                  interpolation=transforms.pick_interpolation(interp, None),
                                  resize_small=int(setting(d, "eval_resize_small") or 0))
        self._affine = spec.affine
        train = split == "train"  # decoded once when it fits (config.data.in_memory_mb)
        what = (f"{spec.name}:{spec.train_split}" if train
                else f"{spec.eval_name}:{spec.eval_split}")
        self.source = decoded.maybe_decode_once(
            source, self._train_geo if train else self._eval_geo, train,
            float(setting(d, "in_memory_mb") or 0), what, logging.info)
        self._order = order.TrainOrder(self.seed, n, b, int(setting(d, "repeated_aug")))
        # ImageNet-ReaL: eval batches also carry 'real', the multi-hot ReaL label sets
        self._label_sets = getattr(getattr(source, "records", None), "label_sets", None)
        self._num_classes = spec.num_classes

    def train_batch(self, step: int) -> Batch:
        """This host's rows of global train batch ``step`` (shuffled, augmented), synchronously."""
        idx = self._order.indices(step, self.lo, self.hi)
        u = order.aug_uniforms(self.seed, step, self.global_batch_size,
                               transforms.NUM_UNIFORMS)[self.lo:self.hi]
        x, y = self.source.read(idx, u, self._train_geo, self._affine)
        out = {"image": x, "label": y}
        if self.return_index:
            out["index"] = idx.astype(np.int32)
        return out

    def eval_batch(self, b: int) -> Batch:
        """This host's rows of global eval batch ``b`` (split order, padded past the end)."""
        pos = b * self.global_batch_size + np.arange(self.lo, self.hi)
        real = pos < self.num_examples
        x = np.zeros((len(pos),) + self.image_shape, self.source.pixel_dtype)
        y = np.zeros(len(pos), np.int32)
        if real.any():
            x[real], y[real] = self.source.read(pos[real], None, self._eval_geo, self._affine)
        out = {"image": x, "label": y, "mask": real.astype(np.float32)}
        if self._label_sets is not None:
            out["real"] = np.zeros((len(pos), self._num_classes), np.uint8)
            out["real"][real] = real_labels.multi_hot(self._label_sets(pos[real]), self._num_classes)
        if self.return_index:
            out["index"] = np.where(real, pos, -1).astype(np.int32)
        return out

    def train_batches(self, start_step: int = 0) -> Prefetcher[Batch]:
        """Infinite iterator of the batches of steps start_step, start_step + 1, ...; computed
        ``config.data.prefetch`` ahead in a daemon thread. Close it (or drop it) to stop.
        Shuffled and augmented; meant for the 'train' pipeline but works on either."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        make = lambda: ordered_map(self.train_batch, itertools.count(start_step),  # noqa: E731
                                   self.source.batches_in_flight)
        return Prefetcher(make, self.prefetch, name=f"data-train-{start_step}")

    def eval_batches(self) -> Prefetcher[Batch]:
        """One pass over the split in order, unaugmented: ceil(N / global batch) batches on every
        host (``steps_per_epoch`` of an 'eval' pipeline), the last one padded and masked."""
        n_batches = order.num_eval_batches(self.num_examples, self.global_batch_size)
        make = lambda: ordered_map(self.eval_batch, range(n_batches),  # noqa: E731
                                   self.source.batches_in_flight)
        return Prefetcher(make, self.prefetch, name="data-eval")

    def close(self) -> None:
        """Releases the source's resources, if any; iterators already made are closed separately."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


def train_examples(config: Any, spec: dataspec.DataSpec | None = None) -> int:
    """The examples of the train split a run steps over (its 'train' Pipeline's
    ``num_examples``: ``data.num_train_examples`` of ``data.train_split``), read without building
    the pipeline (the report's run length of a ``num_epochs`` run). Raises as make_pipeline."""
    spec = dataspec.resolve_data_spec(config) if spec is None else spec
    workers = config.data.get("num_workers") or default_num_workers()
    return len(_open_source(spec.data_dir, spec.name, spec.train_split,
                            config.data.get("num_train_examples"), workers))


def make_pipeline(config: Any, split: str, spec: dataspec.DataSpec | None = None, *,
                  process_index: int | None = None, process_count: int | None = None) -> Pipeline:
    """Opens the DataSpec's train split (split='train') or eval split (split='eval').

    ``spec``: the run's ``resolve_data_spec(config)`` (resolved here when None). The batch sizes,
    seed and augmentation keys come from ``config``. ``process_index``/``process_count`` default
    to ``jax.process_index()``/``process_count()``. Raises ValueError for a bad config,
    ``DatasetNotFoundError`` for unprepared tfds data.
    """
    spec = dataspec.resolve_data_spec(config) if spec is None else spec
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    d = config.data
    gb = config.batch_size if split == "train" else config.eval_batch_size
    order.host_rows(gb, process_index, process_count)  # fail before reading any data
    train = split == "train"
    tfds_split = spec.train_split if train else spec.eval_split
    dataspec.check_labelled("train_split" if train else "eval_split",
                            spec.name if train else spec.eval_name, tfds_split)
    limit = d.get("num_train_examples") if train else d.get("num_eval_examples")
    workers = d.get("num_workers") or default_num_workers()
    source = _open_source(spec.data_dir, spec.name if train else spec.eval_name, tfds_split, limit,
                          workers, "data.train_split" if train else "data.eval_split")
    return Pipeline(config, spec, split, source, process_index, process_count)

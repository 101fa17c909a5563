"""Sources: read examples by index and finish them (``transforms``' two stages, value range).

``ArraySource`` holds a split in host memory (digits, CIFAR) and transforms it with numpy;
``JpegSource`` reads encoded images from a random-access tfds data source (ImageNet), so each host
only reads the examples of its own rows, and decodes them with TensorFlow ops on tf.data's thread
pool (``tf_images``). ``ArraySource`` returns float32 model input ``x01 * scale + shift``,
``JpegSource`` uint8 pixels (``pixel_dtype``) that the steps map on the device
(``stats.model_input``); labels are int32. Both are pure functions of (indices, uniforms, geometry).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from normvit_jax.data import tf_images, transforms

Affine = tuple[np.ndarray, np.ndarray]  # (scale, shift): model input = x01 * scale + shift


@dataclasses.dataclass(frozen=True)
class Geometry:
    size: int               # output side
    rrc: bool               # random resized crop (train only)
    min_area: float         # smallest area fraction of the random resized crop
    fraction: float         # central crop fraction when not rrc
    padding: int = 0        # train: zero-pad and random crop back (stage 2)
    flip: bool = False      # train: random horizontal flip (stage 2)
    antialias: bool = True  # widen the filter when shrinking (PIL); False: TF's plain resize
    interpolation: str = "bilinear"  # "bicubic", or "random": one of them per example (train)
    resize_small: int = 0   # eval: shorter side to this ('area'), then the central crop (big_vision)


class ArraySource:
    batches_in_flight = 1  # numpy on the producer thread is fast enough for these small images
    pixel_dtype = np.float32

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, np.asarray(labels, np.int32)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, idx: np.ndarray, u: np.ndarray | None, geo: Geometry, affine: Affine
             ) -> tuple[np.ndarray, np.ndarray]:
        x = self.images[idx]
        pixels = x.dtype == np.uint8
        x = x.astype(np.float32) / 255.0 if pixels else x.astype(np.float32)
        x = transforms.array_to_size(x, geo.size, u, rrc=geo.rrc, min_area=geo.min_area,
                                     fraction=geo.fraction, antialias=geo.antialias,
                                     interpolation=geo.interpolation,
                                     resize_small=geo.resize_small)
        if pixels and geo.interpolation != "bilinear":
            x = np.clip(x, 0.0, 1.0)  # cubic overshoot, clipped as PIL's uint8 resize does
        if u is not None:
            x = transforms.pad_crop_flip(x, u, geo.padding, geo.flip)
        return (x * affine[0] + affine[1]).astype(np.float32), self.labels[idx]


class JpegSource:
    """Encoded images by index: from ``examples``, the split's serialized ``tf.train.Example``
    records (tfds's array_record reader; parsed by TF, the reads release the GIL), else from
    ``records``, tfds's decoded ``{'image': bytes, 'label': int}`` dicts (mock data, ReaL)."""

    # Batches decoded at once, each by its own tf.data pool: while one reads its records (Python)
    # or waits for its slowest image, the others keep the cores busy. On this project's 2-core VM
    # (batch 256, 2 decode workers) 1,310 images/s with 2 in flight, 1,960 with 4.
    batches_in_flight = 4
    pixel_dtype = np.uint8

    def __init__(self, records: Any, num_examples: int, workers: int, examples: Any = None,
                 where: str = "the split"):
        self.records, self.examples, self.n, self.where = records, examples, num_examples, where
        self._decode = tf_images.BatchDecoder(workers)

    def __len__(self) -> int:
        return self.n

    def read(self, idx: np.ndarray, u: np.ndarray | None, geo: Geometry, affine: Affine
             ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images (the steps apply ``affine``, see ``stats.model_input``) and labels."""
        try:
            if self.examples is not None:  # one batched read: the GIL is released for all of it
                try:
                    recs = self.examples.__getitems__([int(i) for i in idx])
                except RuntimeError as e:  # array_record's error for a file cut short or damaged
                    raise ValueError(
                        f"{self.where}: its array_record files cannot be read ({e}); one was "
                        "damaged after it was written: prepare the dataset again (python -m "
                        "normvit_jax.data.prepare ... --overwrite) or build it again with tfds"
                    ) from None
                return self._decode(recs, u, geo, examples=True)
            recs = [self.records[int(i)] for i in idx]
            x, _ = self._decode([r["image"] for r in recs], u, geo)
        except tf_images.BadImageError as e:
            raise ValueError(self._undecodable(int(idx[e.position]), e.reason)) from None
        return x, np.array([int(r["label"]) for r in recs], np.int32)

    def _undecodable(self, k: int, reason: str) -> str:
        """One line: example k of which split, its file where the record names one (tfds's
        ImageNet: 'file_name'), TensorFlow's own reason (not the graph's 'Graph execution
        error:') and what to do; it was 'example k of the split cannot be decoded: Graph
        execution error:'."""
        image, name = None, None
        try:
            if self.examples is not None:
                tf = tf_images._tf()  # pylint: disable=protected-access
                feats = tf.train.Example.FromString(self.examples.__getitems__([k])[0]).features
                f = feats.feature
                image = f["image"].bytes_list.value[0] if "image" in f else None
                if "file_name" in f and f["file_name"].bytes_list.value:
                    name = f["file_name"].bytes_list.value[0]
            else:
                rec = self.records[k]
                image, name = rec["image"], rec.get("file_name")
            if isinstance(name, bytes):
                name = name.decode("utf-8", "backslashreplace")
            reason = (tf_images.decode_error(image) if image is not None else None) or reason
        except Exception:  # noqa: BLE001  (the line is still given, with what is known)
            pass
        return (f"example {k} of {self.where}{f' (file {name})' if name else ''} cannot be "
                f"decoded by TensorFlow ({' '.join(reason.split())}); if the dataset was made by "
                "python -m normvit_jax.data.prepare, prepare it again (--overwrite: it now skips "
                "and names such files), else remove or replace the file")

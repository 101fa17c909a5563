"""A split of encoded images decoded once into host memory (``config.data.in_memory_mb``).

``JpegSource`` decodes every image again for every batch: on a small dataset and a small CPU the
host then decodes on the cores the train step needs. When the split's decoded images fit the
budget, ``maybe_decode_once`` decodes them once, at start, through the same TensorFlow decoder and
the same deterministic first stage (crop window, resize, rounding to uint8: ``tf_images``), and
``DecodedSource`` applies the random second stage (pad-and-crop, flip: integer indexing, the same
rule as ``tf_images._finish_one``) in numpy. The batches are the decoding path's, bit for bit.

Only a geometry whose first stage takes no random draw is kept: not ``random_resized_crop``, not
``interpolation='random'`` in training (an eval geometry always qualifies). Reads with another
geometry, or when the split does not fit, go to the decoding source unchanged.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from normvit_jax.data import transforms
from normvit_jax.data.sources import Affine, Geometry

_CHUNK = 512  # images per decode call while filling the memory


def first_stage(geo: Geometry, train: bool) -> Geometry | None:
    """The deterministic part of ``geo`` (no pad-and-crop, no flip; evaluation's interpolation), or
    None when it depends on an example's random draws."""
    if not train:
        interp = transforms.pick_interpolation(geo.interpolation, None)
        return dataclasses.replace(geo, padding=0, flip=False, interpolation=interp)
    if geo.rrc or geo.interpolation == "random":
        return None
    return dataclasses.replace(geo, padding=0, flip=False)


def decoded_mib(num_examples: int, size: int) -> float:
    """MiB of ``num_examples`` decoded uint8 RGB images of ``size x size``."""
    return num_examples * size * size * 3 / 2 ** 20


class DecodedSource:
    """The decoded first stage of every example of ``inner`` for one geometry, with its labels."""

    batches_in_flight = 1  # numpy indexing: far faster than the step it feeds
    pixel_dtype = np.uint8

    def __init__(self, inner: Any, stage: Geometry, images: np.ndarray, labels: np.ndarray):
        self.inner, self.stage, self.images, self.labels = inner, stage, images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, idx: np.ndarray, u: np.ndarray | None, geo: Geometry, affine: Affine
             ) -> tuple[np.ndarray, np.ndarray]:
        """As ``JpegSource.read``: uint8 images and int32 labels."""
        if first_stage(geo, u is not None) != self.stage:
            return self.inner.read(idx, u, geo, affine)
        x = self.images[idx]
        if u is not None:
            x = transforms.pad_crop_flip(x, u, geo.padding, geo.flip)
        return x, self.labels[idx]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def maybe_decode_once(source: Any, geo: Geometry, train: bool, budget_mib: float,
                      what: str = "the split", log: Any = None) -> Any:
    """``DecodedSource`` over ``source`` when it decodes on the fly (``uint8`` pixels, e.g.
    ``JpegSource``), ``geo``'s first stage is deterministic and the decoded split fits
    ``budget_mib``; else ``source`` itself. ``log(msg, *args)`` says what was done to ``what``."""
    stage = first_stage(geo, train)
    n = len(source)
    if (budget_mib <= 0 or stage is None or getattr(source, "pixel_dtype", None) != np.uint8
            or isinstance(source, DecodedSource) or decoded_mib(n, geo.size) > budget_mib):
        return source
    t = time.perf_counter()
    images = np.empty((n, geo.size, geo.size, 3), np.uint8)
    labels = np.empty(n, np.int32)
    for lo in range(0, n, _CHUNK):
        idx = np.arange(lo, min(n, lo + _CHUNK))
        images[idx], labels[idx] = source.read(idx, None, stage, (None, None))
    if log is not None:
        log("Decoded the %d images of %s once into memory (%.0f MiB, %.1f s); its batches are "
            "%s from there (config.data.in_memory_mb=%g).", n, what,
            decoded_mib(n, geo.size), time.perf_counter() - t,
            "augmented" if train else "read", budget_mib)
    return DecodedSource(source, stage, images, labels)

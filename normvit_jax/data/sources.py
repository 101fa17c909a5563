"""Sources: read examples by index and bring them to ``size x size`` (transforms stage 1).

``ArraySource`` holds a split in host memory (digits, CIFAR); ``JpegSource`` decodes JPEGs from a
random-access tfds data source in a thread pool (ImageNet), so each host only reads the examples
of its own rows. Both return float32 images in [0, 1] and int32 labels.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import io
from typing import Any

import numpy as np

from normvit_jax.data import transforms


@dataclasses.dataclass(frozen=True)
class Geometry:
    size: int               # output side
    rrc: bool               # random resized crop (train only)
    min_area: float         # smallest area fraction of the random resized crop
    fraction: float         # central crop fraction when not rrc


class ArraySource:
    def __init__(self, images: np.ndarray, labels: np.ndarray):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, np.asarray(labels, np.int32)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, idx: np.ndarray, u: np.ndarray | None, geo: Geometry
             ) -> tuple[np.ndarray, np.ndarray]:
        x = self.images[idx]
        x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
        x = transforms.array_to_size(x, geo.size, u, rrc=geo.rrc, min_area=geo.min_area,
                                     fraction=geo.fraction)
        return x, self.labels[idx]


class JpegSource:
    """Records ``{'image': jpeg bytes, 'label': int}`` from an indexable data source."""

    def __init__(self, records: Any, num_examples: int, workers: int):
        self.records, self.n = records, num_examples
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="data-decode")

    def __len__(self) -> int:
        return self.n

    def _one(self, i: int, u: np.ndarray | None, geo: Geometry) -> tuple[np.ndarray, int]:
        from PIL import Image
        rec = self.records[int(i)]
        with Image.open(io.BytesIO(rec["image"])) as img:  # PIL releases the GIL while decoding
            out = transforms.pil_to_size(img.convert("RGB"), geo.size, u, rrc=geo.rrc,
                                         min_area=geo.min_area, fraction=geo.fraction)
        return out, int(rec["label"])

    def read(self, idx: np.ndarray, u: np.ndarray | None, geo: Geometry
             ) -> tuple[np.ndarray, np.ndarray]:
        rows = list(self._pool.map(lambda k: self._one(idx[k], None if u is None else u[k], geo),
                                   range(len(idx))))
        x = np.stack([r[0] for r in rows]) if rows else np.zeros((0, geo.size, geo.size, 3),
                                                                   np.uint8)
        return x.astype(np.float32) / 255.0, np.array([r[1] for r in rows], np.int32)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

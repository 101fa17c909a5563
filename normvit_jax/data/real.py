"""ImageNet-ReaL (tfds 'imagenet2012_real'): the validation images with their original label and
the set of ReaL labels (Beyer et al. 2020), which may be empty (such images are not scored)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class RealRecords:
    """The records seen as ``{'image', 'label'}`` (label: the original ImageNet label) for the
    JPEG source; each record's ReaL set is kept by index until ``label_sets`` takes it."""

    def __init__(self, records: Any):
        self.records = records
        self._sets: dict[int, np.ndarray] = {}  # filled by the decode threads, one key each

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        rec = self.records[int(i)]
        self._sets[int(i)] = np.asarray(rec["real_label"], np.int64).reshape(-1)
        return {"image": rec["image"], "label": rec["original_label"]}

    def label_sets(self, idx: Sequence[int]) -> list[np.ndarray]:
        """The ReaL sets of ``idx`` (read again for any not read through ``__getitem__``)."""
        out = []
        for i in (int(i) for i in idx):
            s = self._sets.pop(i, None)
            out.append(np.asarray(self.records[i]["real_label"], np.int64).reshape(-1)
                       if s is None else s)
        return out


def multi_hot(sets: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """(len(sets), num_classes) uint8 with 1 at each set's labels."""
    out = np.zeros((len(sets), num_classes), np.uint8)
    for row, s in enumerate(sets):
        out[row, np.asarray(s, np.int64)] = 1
    return out

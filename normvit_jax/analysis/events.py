"""Reads the scalar summaries of a workdir's TensorBoard event files, without TensorFlow.

CLU writes scalars with ``tf.summary`` (tensor protos); older writers use ``simple_value``: both
are read. After a resume, the same (tag, step) can be written twice: the last write wins (files in
the order they were started, records in file order). Wall time: each event file belongs to one
process; a point's ``elapsed`` is the time since its file's first event plus the spans of the
earlier files, so idle time between a stop and a restart is not counted.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Iterator

import numpy as np
from etils import epath
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util


@dataclasses.dataclass
class Series:
    """One scalar tag, sorted by step. elapsed: training seconds since the run started."""

    steps: np.ndarray
    values: np.ndarray
    wall: np.ndarray
    elapsed: np.ndarray


@dataclasses.dataclass
class RunSummaries:
    scalars: dict[str, Series]
    wall_time_s: float  # sum over event files of (last event - first event)


def _records(path: epath.Path) -> Iterator[bytes]:
    """TFRecord payloads; a truncated tail (a file still being written) ends the iteration."""
    with path.open("rb") as f:
        while True:
            header = f.read(12)  # uint64 length, uint32 masked crc of the length
            if len(header) < 12:
                return
            (n,) = struct.unpack("<Q", header[:8])
            payload, crc = f.read(n), f.read(4)
            if len(payload) < n or len(crc) < 4:
                return
            yield payload


def _scalar(value) -> float | None:
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor"):
        try:
            arr = tensor_util.make_ndarray(value.tensor)
        except Exception:  # noqa: BLE001  (dtypes tensorboard cannot decode: not scalars)
            return None
        if arr.size == 1 and np.issubdtype(arr.dtype, np.number):
            return float(arr.reshape(()))
    return None


def _read_file(path: epath.Path) -> tuple[list[tuple[str, int, float, float]], float, float]:
    """(tag, step, wall_time, value) of every scalar in file order; first and last wall time."""
    out, first, last = [], None, None
    for payload in _records(path):
        event = event_pb2.Event.FromString(payload)
        first = event.wall_time if first is None else first
        last = event.wall_time
        for v in event.summary.value:
            x = _scalar(v)
            if x is not None:
                out.append((v.tag, int(event.step), float(event.wall_time), x))
    return out, first or 0.0, last or 0.0


def event_files(workdir: str) -> list[epath.Path]:
    return sorted(epath.Path(workdir).glob("events.out.tfevents.*"))


def read_run(workdir: str) -> RunSummaries:
    """All scalar tags of a workdir (last write per (tag, step) wins) and its training wall time."""
    files = [_read_file(p) for p in event_files(workdir)]
    files.sort(key=lambda f: f[1])  # by start time: a restart's file comes after the first one's
    points: dict[str, dict[int, tuple[float, float, float]]] = {}
    offset = 0.0
    for rows, first, last in files:
        for tag, step, wall, value in rows:
            points.setdefault(tag, {})[step] = (value, wall, offset + wall - first)
        offset += last - first
    scalars = {}
    for tag, by_step in points.items():
        steps = np.array(sorted(by_step), np.int64)
        vals = np.array([by_step[s] for s in steps], np.float64).reshape(-1, 3)
        scalars[tag] = Series(steps, vals[:, 0], vals[:, 1], vals[:, 2])
    return RunSummaries(scalars, offset)


def read_scalars(workdir: str) -> dict[str, Series]:
    """tag -> Series of the workdir's scalar summaries (last write per (tag, step) wins)."""
    return read_run(workdir).scalars

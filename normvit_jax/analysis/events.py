"""Reads the scalar summaries of a workdir's TensorBoard event files, without TensorFlow.

CLU writes scalars with ``tf.summary`` (tensor protos); older writers use ``simple_value``: both
are read. After a resume, the same (tag, step) can be written twice: the last write wins (files in
the order they were started, records in file order); the project's resume-aware reader
``normvit_jax.summaries.read_scalars`` is used instead where it exists. Wall time: each event file
belongs to one process; a point's ``elapsed`` is the time spent inside the files' spans (first to
last event) before it, so idle time between a stop and a restart is not counted.
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


def _shared_reader():
    """The project's ``normvit_jax.summaries.read_scalars`` (resume-aware) where it exists."""
    try:
        from normvit_jax import summaries
    except ImportError:
        return None
    return getattr(summaries, "read_scalars", None)


def _own_points(files: list) -> dict[str, dict[int, tuple[float, float]]]:
    points: dict[str, dict[int, tuple[float, float]]] = {}
    for rows, _, _ in files:
        for tag, step, wall, value in rows:
            points.setdefault(tag, {})[step] = (value, wall)
    return points


def read_run(workdir: str) -> RunSummaries:
    """All scalar tags of a workdir and its training wall time.

    Values come from ``normvit_jax.summaries.read_scalars`` where it exists (it also drops what a
    restart superseded), else from this module's reader (last write per (tag, step) wins).
    """
    files = sorted((_read_file(p) for p in event_files(workdir)), key=lambda f: f[1])
    spans = [(first, last) for _, first, last in files]
    shared = _shared_reader()
    if shared is not None:
        points = {tag: {s: (v, w) for s, v, w in pts} for tag, pts in shared(workdir).items()}
    else:
        points = _own_points(files)
    scalars = {}
    for tag, by_step in points.items():
        steps = np.array(sorted(by_step), np.int64)
        vals = np.array([by_step[s] for s in steps], np.float64).reshape(-1, 2)
        scalars[tag] = Series(steps, vals[:, 0], vals[:, 1], elapsed(vals[:, 1], spans))
    return RunSummaries(scalars, float(sum(last - first for first, last in spans)))


def elapsed(wall: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    """Training seconds at each wall time: the time spent inside the event files' (first, last)
    spans before it, so the gaps between a stop and a restart are not counted."""
    wall = np.asarray(wall, np.float64)
    return sum((np.clip(wall - a, 0.0, b - a) for a, b in spans), np.zeros_like(wall))


def read_scalars(workdir: str) -> dict[str, Series]:
    """tag -> Series of the workdir's scalar summaries."""
    return read_run(workdir).scalars

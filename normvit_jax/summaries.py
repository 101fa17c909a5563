"""Reads a run's TensorBoard scalars the way the run meant them, across crashes and resumes.

A run killed after its last checkpoint has already written summaries for steps that its re-run
computes and writes again. Every (re)start of the loop writes, in its own event file, the scalar
``SEGMENT_TAG`` at the step it starts from. ``read_scalars`` reads the event files in the order
they were created and, at each such marker, drops every earlier point after that step (as
TensorBoard's own purge of orphaned data would); within one file the last write of a (tag, step)
wins. The result is the history of the run that reached the end, whatever was killed on the way.
Resumes are exact, so the dropped points equal their rewrites except the timing scalars
(``TIMING_TAGS``).

No TensorFlow needed: TFRecord framing is read here, the protos come from ``tensorboard``.
"""
from __future__ import annotations

import struct
from typing import Iterator

import numpy as np
from etils import epath

SEGMENT_TAG = "run/start_step"
TIMING_TAGS = ("steps_per_sec", "uptime", "train/steps_per_sec", "train/examples_per_sec")

Point = tuple[int, float, float]  # (step, value, wall_time)


def _records(data: bytes) -> Iterator[bytes]:
    """TFRecord payloads; stops quietly at a truncated tail (a writer killed mid-record)."""
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        start, end = pos + 12, pos + 12 + length
        if end + 4 > len(data):
            return
        yield data[start:end]
        pos = end + 4


def _scalar_events(path: epath.Path) -> Iterator[tuple[str, int, float, float]]:
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    scalar_tags: set[str] = set()
    for raw in _records(path.read_bytes()):
        event = event_pb2.Event()
        try:
            event.ParseFromString(raw)
        except Exception:  # noqa: BLE001  (a damaged record ends what can be trusted)
            return
        for v in event.summary.value:
            if v.metadata.plugin_data.plugin_name == "scalars":
                scalar_tags.add(v.tag)
            if v.HasField("simple_value"):
                value = float(v.simple_value)
            elif v.HasField("tensor") and v.tag in scalar_tags:
                arr = tensor_util.make_ndarray(v.tensor)
                if arr.size != 1:
                    continue
                value = float(np.asarray(arr).reshape(()))
            else:
                continue
            yield v.tag, int(event.step), value, float(event.wall_time)


def event_files(workdir: str) -> list[epath.Path]:
    """The run's event files (directly in ``workdir``), oldest first by their first record."""
    root = epath.Path(workdir)
    files = [p for p in root.iterdir() if p.name.startswith("events.out.tfevents")] \
        if root.exists() else []

    def created(p: epath.Path) -> tuple[float, str]:
        from tensorboard.compat.proto import event_pb2
        first = next(_records(p.read_bytes()[:4096]), None)
        t = float("inf")
        if first is not None:
            e = event_pb2.Event()
            try:
                e.ParseFromString(first)
                t = e.wall_time
            except Exception:  # noqa: BLE001
                pass
        return t, p.name

    return sorted(files, key=created)


def read_scalars(workdir: str, *, include_timing: bool = True
                 ) -> dict[str, list[Point]]:
    """``{tag: [(step, value, wall_time), ...]}`` sorted by step, one point per step: the run's
    history after dropping what a resume superseded (module docstring). ``SEGMENT_TAG`` itself is
    left out; ``include_timing=False`` also leaves out ``TIMING_TAGS`` (they differ between an
    interrupted run and an uninterrupted one by nature)."""
    history: dict[str, dict[int, tuple[float, float]]] = {}
    for path in event_files(workdir):
        for tag, step, value, wall in _scalar_events(path):
            if tag == SEGMENT_TAG:  # a (re)start at `step`: later points of earlier files are void
                for points in history.values():
                    for s in [s for s in points if s > step]:
                        del points[s]
                continue
            if not include_timing and tag in TIMING_TAGS:
                continue
            history.setdefault(tag, {})[step] = (value, wall)
    return {tag: [(s, v, w) for s, (v, w) in sorted(points.items())]
            for tag, points in sorted(history.items()) if points}

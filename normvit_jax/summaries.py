"""Reads a run's TensorBoard scalars the way the run meant them, across crashes and resumes.

A run killed after its last checkpoint has already written summaries for steps that its re-run
computes and writes again. Every (re)start of the loop writes, in its own event file, the scalar
``SEGMENT_TAG`` at the step it starts from. ``read_scalars`` reads the event files in the order
they were created and, at each such marker, drops every earlier point after that step (as
TensorBoard's own purge of orphaned data would); within one file the last write of a (tag, step)
wins. The result is the history of the run that reached the end, whatever was killed on the way.
Resumes are exact, so the dropped points equal their rewrites except the timing scalars
(``TIMING_TAGS``).

``read_run`` adds the training wall time: each event file belongs to one process; a point's
``elapsed`` is the time spent inside the files' spans (first to last event) before it, so idle
time between a stop and a restart is not counted. A file's first event (``SEGMENT_TAG``, at step 0
the hparams too) is written before the train step compiles: the compilation is inside the span,
only the process's Python/JAX start-up before it.

Files are read with TensorBoard's own event loader (through TensorFlow's record reader where it
is installed, TensorBoard's stub otherwise), which ends a file quietly at a truncated or damaged
record. So the records' framing is walked as well (``_record_offsets``): a file whose reading stopped
before its end is one warning naming it, the byte and the step it was read up to (``read_scalars``,
``read_run``; ``RunSummaries.damaged`` holds the lines), unless a later file's ``SEGMENT_TAG``
starts at or before that step: then the lost tail is what a killed run left and its re-run wrote
again, and nothing is missing.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING, Iterator

import numpy as np
from absl import logging
from etils import epath

if TYPE_CHECKING:
    from tensorboard.compat.proto import event_pb2

SEGMENT_TAG = "run/start_step"
# the loop's timing scalars; "steps_per_sec" and "uptime" are CLU's, in runs written before
# train/tensorboard.py replaced its writer
TIMING_TAGS = ("steps_per_sec", "uptime", "train/steps_per_sec", "train/examples_per_sec")

Point = tuple[int, float, float]  # (step, value, wall_time)


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
    # sum over event files of (last event - first event); a run's first event (run/start_step,
    # the hparams) is written before the train step compiles, so compilation is included and only
    # the process's Python/JAX start-up is not
    wall_time_s: float
    # the step each (re)start of the loop began at (its SEGMENT_TAG), in file order; empty for
    # runs written before the marker existed
    start_steps: list[int] = dataclasses.field(default_factory=list)
    # one line per event file whose reading stopped at damage with points missing (read_scalars'
    # warnings)
    damaged: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _EventFile:
    path: epath.Path
    scalars: list[tuple[str, int, float, float]]  # (tag, step, value, wall_time) in file order
    first: float  # wall time of the first event (inf if none could be read)
    last: float
    last_step: int | None = None  # of the last event read
    damage: str | None = None  # 'at byte N of M (...)' when reading stopped before the end


def events(path: epath.Path | str) -> Iterator[event_pb2.Event]:
    """The events of one file in order (TensorBoard's ``EventFileLoader``: legacy ``simple_value``
    scalars come back as scalar tensors); stops quietly at a truncated or damaged record."""
    from tensorboard.backend.event_processing import event_file_loader

    return event_file_loader.EventFileLoader(str(path)).Load()


def _record_offsets(path: epath.Path, size: int) -> tuple[list[int], int | None]:
    """(start offset of each record whose framing is intact within the first ``size`` bytes, offset
    where the framing breaks or None). A TFRecord is an 8-byte length, its masked CRC32C, the data
    and the data's masked CRC32C; only the 12-byte headers are read (seeking over the data, which
    the loader has read: no second download of a gs:// file), and the data's CRC is left to the
    loader (``_read_file`` compares the counts). ``size``: taken before the loader read, so a
    live run's records appended since are not compared."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    offsets, pos = [], 0
    with path.open("rb") as f:
        while pos < size:
            f.seek(pos)
            header = f.read(12)
            if len(header) < 12:
                return offsets, pos
            (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
            if masked_crc32c(header[:8]) != crc or pos + 12 + length + 4 > size:
                return offsets, pos
            offsets.append(pos)
            pos += 12 + length + 4
    return offsets, None


def _read_file(path: epath.Path) -> _EventFile:
    """Every scalar of one event file and its first/last wall time, in one pass, and where the
    reading stopped if that is before the file's end."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.util import tensor_util

    scalar_tags: set[str] = set()  # a writer sends a tag's plugin metadata with its first value only
    rows: list[tuple[str, int, float, float]] = []
    first, last = float("inf"), float("-inf")
    last_step, records, initial_metadata = None, 0, {}
    size = path.stat().length  # before the loader: what a live writer appends later is not read
    for record in event_file_loader.RawEventFileLoader(str(path)).Load():
        records += 1
        for event in _events_of(record, initial_metadata):
            first = event.wall_time if first == float("inf") else first
            last = event.wall_time
            last_step = int(event.step)
            _scalars(event, scalar_tags, rows, tensor_util)
    offsets, broken = _record_offsets(path, size)
    damage = None
    if records < len(offsets) or (broken is not None and records <= len(offsets)):
        at = offsets[records] if records < len(offsets) else broken
        damage = f"at byte {at} of {size} (record {records + 1} is truncated or corrupt)"
    return _EventFile(path, rows, first, last, last_step, damage)


def _events_of(record: bytes, initial_metadata: dict) -> list[event_pb2.Event]:
    """One record's event(s) as ``EventFileLoader`` yields them (its read-time compat layers;
    ``initial_metadata``: the per-file memo the loader keeps)."""
    from tensorboard import data_compat, dataclass_compat
    from tensorboard.compat.proto import event_pb2

    event = data_compat.migrate_event(event_pb2.Event.FromString(record))
    return dataclass_compat.migrate_event(event, initial_metadata)


def _scalars(event: event_pb2.Event, scalar_tags: set[str], rows: list, tensor_util) -> None:
    """Appends the scalar values of ``event`` to ``rows``."""
    for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name == "scalars":
            scalar_tags.add(v.tag)
        if not (v.HasField("tensor") and v.tag in scalar_tags):
            continue
        arr = tensor_util.make_ndarray(v.tensor)
        if arr.size == 1:
            rows.append((v.tag, int(event.step), float(np.asarray(arr).reshape(())),
                         float(event.wall_time)))


def _event_paths(workdir: str) -> list[epath.Path]:
    root = epath.Path(workdir)
    return [p for p in root.iterdir() if p.name.startswith("events.out.tfevents")] \
        if root.exists() else []


def _read_files(workdir: str) -> list[_EventFile]:
    """The run's event files (directly in ``workdir``), oldest first by their first event."""
    return sorted((_read_file(p) for p in _event_paths(workdir)), key=lambda f: (f.first, f.path.name))


def event_files(workdir: str) -> list[epath.Path]:
    """The run's event files, oldest first by their first event."""
    return [f.path for f in _read_files(workdir)]


def _damaged(files: list[_EventFile], warn: bool = True) -> list[str]:
    """One line per file whose reading stopped at damage with points missing: those after its
    last step read, unless a later file's (re)start marker is at or before that step (the tail
    a killed run left, which its re-run wrote again). Logged as warnings with ``warn``."""
    lines = []
    for i, f in enumerate(files):
        if f.damage is None:
            continue
        read_to = -1 if f.last_step is None else f.last_step
        restarts = [step for g in files[i + 1:] for tag, step, _, _ in g.scalars
                    if tag == SEGMENT_TAG]
        if restarts and min(restarts) <= read_to:
            continue
        lines.append(f"the event file {f.path} is damaged {f.damage}: its points were read up "
                     f"to step {f.last_step if f.last_step is not None else '(none)'}; later "
                     "ones in it are missing")
    if warn:
        for line in lines:
            logging.warning("%s", line)
    return lines


def _history(files: list[_EventFile], include_timing: bool) -> dict[str, list[Point]]:
    history: dict[str, dict[int, tuple[float, float]]] = {}
    for f in files:
        for tag, step, value, wall in f.scalars:
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


def read_scalars(workdir: str, *, include_timing: bool = True
                 ) -> dict[str, list[Point]]:
    """``{tag: [(step, value, wall_time), ...]}`` sorted by step, one point per step: the run's
    history after dropping what a resume superseded (module docstring). ``SEGMENT_TAG`` itself is
    left out; ``include_timing=False`` also leaves out ``TIMING_TAGS`` (they differ between an
    interrupted run and an uninterrupted one by nature). A damaged event file is one warning
    line (module docstring); its points before the damage are kept."""
    files = _read_files(workdir)
    _damaged(files)
    return _history(files, include_timing)


def read_run(workdir: str) -> RunSummaries:
    """All scalar tags of a workdir as ``Series`` (as ``read_scalars``: a damaged file is one
    warning, and its line in ``damaged``) and its training wall time."""
    files = _read_files(workdir)
    spans = [(f.first, f.last) for f in files if f.first <= f.last]
    scalars = {}
    for tag, points in _history(files, include_timing=True).items():
        pts = np.array(points, np.float64).reshape(-1, 3)
        scalars[tag] = Series(pts[:, 0].astype(np.int64), pts[:, 1], pts[:, 2],
                              elapsed(pts[:, 2], spans))
    starts = [step for f in files for tag, step, _, _ in f.scalars if tag == SEGMENT_TAG]
    return RunSummaries(scalars, float(sum(last - first for first, last in spans)), starts,
                        _damaged(files))


def elapsed(wall: np.ndarray, spans: list[tuple[float, float]]) -> np.ndarray:
    """Training seconds at each wall time: the time spent inside the event files' (first, last)
    spans before it, so the gaps between a stop and a restart are not counted."""
    wall = np.asarray(wall, np.float64)
    return sum((np.clip(wall - a, 0.0, b - a) for a, b in spans), np.zeros_like(wall))


def last_step(workdir: str) -> int | None:
    """The largest step any scalar of the workdir's event files was written at (None: none), read
    raw: how far the run got, for checkpoints.checkpoints_gone."""
    steps = [step for f in _read_files(workdir) for _, step, _, _ in f.scalars]
    return max(steps) if steps else None

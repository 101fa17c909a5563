"""A damaged event file (truncated, or zeroed in the middle) ended quietly where the damage
began: read_scalars kept the points before it without a word, so analysis.report showed a final
top-1 of step 30 for a run that ended at 60 and called it "still training?". Now each damaged file
is one warning naming it, the byte where reading stopped and the step it was read up to, and
read_run (the report's reader) carries the same lines for the report to note for that run."""
from __future__ import annotations

import glob
import logging
import os
import time

import pytest

from normvit_jax import summaries


def _write(folder, points, suffix=""):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    w = EventFileWriter(str(folder), filename_suffix=suffix)
    for tag, step, value in points:
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        w.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
    w.close()
    time.sleep(0.01)
    (path,) = [p for p in glob.glob(str(folder / "events.out.tfevents*")) if p.endswith(suffix)]
    return path


def _run(folder):
    return _write(folder, [(summaries.SEGMENT_TAG, 0, 0.0)]
                  + [p for s in range(1, 61) for p in [("train/loss", s, 1.0 / s)]
                     + ([("eval/top1", s, s / 100)] if s % 30 == 0 else [])], ".a")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_event_file_is_named_with_the_step_it_was_read_to(tmp_path, caplog, damage):
    path = _run(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(size // 2 + 7)
        else:
            f.seek(size // 3)
            f.write(b"\0" * 200)
    with caplog.at_level(logging.WARNING):
        got = summaries.read_scalars(str(tmp_path))
    last = got["train/loss"][-1][0]
    assert 5 < last < 60 and got.get("eval/top1", [(0,)])[-1][0] < 60  # the points before it
    lines = [m for m in _warnings(caplog) if os.path.basename(path) in m]
    assert len(lines) == 1 and "\n" not in lines[0], _warnings(caplog)
    assert f"read up to step {last}" in lines[0] and "damaged" in lines[0], lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run = summaries.read_run(str(tmp_path))
    assert run.damaged == lines and len(_warnings(caplog)) == 1


def test_intact_files_and_a_tail_a_resume_rewrote_say_nothing(tmp_path, caplog):
    """A run killed mid-write leaves its last record cut short; the re-run's segment starts at
    or before the last step read from it, so nothing is missing: no warning."""
    a = _write(tmp_path, [(summaries.SEGMENT_TAG, 0, 0.0)]
               + [("loss", s, float(s)) for s in range(1, 7)], ".a")
    with open(a, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00garbage")  # the record a kill cut short
    _write(tmp_path, [(summaries.SEGMENT_TAG, 6, 6.0), ("loss", 7, 7.0)], ".b")
    with caplog.at_level(logging.WARNING):
        got = summaries.read_scalars(str(tmp_path))
        run = summaries.read_run(str(tmp_path))
    assert [s for s, _, _ in got["loss"]] == list(range(1, 8))
    assert not _warnings(caplog) and run.damaged == []


def test_records_appended_after_the_reading_started_are_not_damage(tmp_path, caplog):
    """A live run appends records while the report reads: the framing is walked only over the
    bytes that were there before the loader read (the size taken first), by their 12-byte
    headers. A file that is whole at that size is not damaged, whatever follows it; cut in a
    record at that size, it is (a truncated file reads the same)."""
    from etils import epath
    path = epath.Path(_run(tmp_path))
    size = path.stat().length
    offsets, broken = summaries._record_offsets(path, size)
    assert broken is None and len(offsets) == 1 + 1 + 60 + 2  # file version, start marker, 60 + 2 points
    with open(path, "ab") as f:  # a record a writer has begun: its header only
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00")
    assert summaries._record_offsets(path, size) == (offsets, None)
    cut, at = summaries._record_offsets(path, offsets[10] + 5)
    assert cut == offsets[:10] and at == offsets[10]

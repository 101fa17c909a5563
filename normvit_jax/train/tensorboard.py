"""TensorBoard summaries without TensorFlow: the loop's scalars, the eval analysis's images and the
run's hyperparameters, framed by the ``tensorboard`` package's own ``RecordWriter`` and built with
its summary protos, in the format ``tf.summary`` writes (the 'scalars', 'images' and 'hparams'
plugins' tensors), so TensorBoard and ``normvit_jax.summaries`` read them as before.

Why not CLU's SummaryWriter: importing it imports TensorFlow, 6-10 s of CPU at the start of every
training run, for a few records per log step, and a machine without TensorFlow (the GPU hosts)
could not train at all. Nor tensorboard's ``EventFileWriter``: it opens its file through
``tf.io.gfile``, which imports TensorFlow too where it is installed. The file is opened with
``etils.epath`` as the rest of the workdir (a local path without TensorFlow, gs:// with it). The
methods are those of CLU's ``MetricWriter`` that the loop calls."""
from __future__ import annotations

import io
import itertools
import os
import socket
import time
from typing import Any, Mapping

import numpy as np
from etils import epath
from PIL import Image
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.scalar import summary as scalar_summary
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

_FILE_NUMBER = itertools.count()  # tells apart the files one process opens in one second
REMOTE_FLUSH_S = 60.0  # a remote (gs://) event file is flushed at most this often (and by flush)


class SummaryWriter:
    """Appends to a new event file in ``logdir``, named as TensorFlow names them
    (``events.out.tfevents.<time>.<host>.<pid>.<n>``); on a local path each record is flushed as
    it is written; on a remote one (gs://) at most every ``REMOTE_FLUSH_S`` seconds, and by
    ``flush`` (the loop's, before each checkpoint) and ``close``."""

    def __init__(self, logdir: str):
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILE_NUMBER)}")
        path = epath.Path(logdir)
        from normvit_jax import workdir  # pylint: disable=import-outside-toplevel
        self._remote = workdir.is_remote(logdir)
        self._flushed = time.monotonic()
        self._path = path / name
        self._failed = False
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._records = RecordWriter(self._path.open("wb"))
            self._records.write(event_pb2.Event(wall_time=time.time(),
                                                file_version="brain.Event:2").SerializeToString())
            self._records.flush()
        except OSError as e:
            self._failed = True
            raise self._error(e) from None

    def _error(self, e: BaseException) -> Exception:
        """A failed write (a full disk, permissions) as the WorkdirError of a failed checkpoint:
        one line, exit 5 (``cli``)."""
        from normvit_jax import workdir  # pylint: disable=import-outside-toplevel
        return workdir.WorkdirError(
            f"writing the TensorBoard summaries to {self._path} failed ({type(e).__name__}: {e}); "
            "free disk space or fix the workdir, then run the same command again to continue "
            "from the newest complete checkpoint")

    def _add(self, step: int, values: list[Any]) -> None:
        """Writes one record and flushes it: TensorBoard (and ``summaries``) read the file while
        the run goes on, and unflushed records waited for the next checkpoint save (a run on a
        slow CPU showed TensorBoard ~400 steps behind its log). A record is written once per log
        step or eval and is small (a few hundred bytes; the eval images a few kB), so one flush
        per record costs one write of it; flushing every N seconds instead would leave the last
        record of a quiet stretch (a slow log interval) unwritten until the next one. Not so on a
        remote path: an object store (tf.io.gfile's gs://) uploads the whole file again at each
        flush, so there it is flushed at most every ``REMOTE_FLUSH_S`` seconds (and before each
        checkpoint, by the loop's ``flush``)."""
        if values:
            try:
                self._records.write(event_pb2.Event(
                    step=int(step), wall_time=time.time(),
                    summary=summary_pb2.Summary(value=values)).SerializeToString())
            except OSError as e:
                self._failed = True
                raise self._error(e) from None
            if not self._remote or time.monotonic() - self._flushed >= REMOTE_FLUSH_S:
                self.flush()

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        self._add(step, [v for tag, x in scalars.items()
                         for v in scalar_summary.scalar_pb(tag, float(np.asarray(x))).value])

    def write_images(self, step: int, images: Mapping[str, Any]) -> None:
        """Each value: uint8 (N, H, W, C) or (H, W, C), C in 1, 3, 4; one tag holds the N images
        (as ``tf.summary.image``: a string tensor [width, height, png, ...])."""
        values = []
        for tag, x in images.items():
            x = np.asarray(x)
            x = x[None] if x.ndim == 3 else x
            if x.dtype != np.uint8:
                raise ValueError(f"image summary {tag!r}: uint8 expected, got {x.dtype}")
            parts = [str(x.shape[2]).encode(), str(x.shape[1]).encode(), *map(_png, x)]
            values.append(summary_pb2.Summary.Value(
                tag=tag, metadata=image_metadata.create_summary_metadata(
                    display_name=tag, description=""),
                tensor=tensor_util.make_tensor_proto(np.array(parts, dtype=object))))
        self._add(step, values)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._add(0, list(hparams_summary.hparams_pb(dict(hparams)).value))

    def flush(self) -> None:
        """Raises WorkdirError (one line, exit 5) when the write fails."""
        try:
            self._records.flush()
        except OSError as e:
            self._failed = True
            raise self._error(e) from None
        self._flushed = time.monotonic()

    def close(self) -> None:
        """Closes the file; after a failed write (already raised) it never raises: the records
        that did not fit are lost, the error said so."""
        if self._records.closed:
            return
        try:
            self._records.close()
        except OSError as e:
            if not self._failed:
                self._failed = True
                raise self._error(e) from None
            try:  # the buffered bytes cannot be written: close the file without them
                self._records._writer.close()  # pylint: disable=protected-access
            except Exception:  # noqa: BLE001
                pass


class NullWriter:
    """The writer of processes other than 0: every process computes the same metrics, and one
    writes them."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        pass

    def write_images(self, step: int, images: Mapping[str, Any]) -> None:
        pass

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buf, format="PNG")
    return buf.getvalue()

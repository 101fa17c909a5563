"""The loop's TensorBoard writer (normvit_jax/train/tensorboard.py): what it writes is read back by
TensorBoard's own loader (``EventAccumulator``, which TensorBoard's UI uses) with the same values,
and a training run no longer imports TensorFlow."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from normvit_jax.train import tensorboard
from tests.conftest import REPO_ROOT


def _accumulator(logdir: str):
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.TENSORS: 0, event_accumulator.IMAGES: 0})
    acc.Reload()
    return acc


def _scalars(acc, tag: str) -> list[tuple[int, float]]:
    from tensorboard.util import tensor_util
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_tensorboard_reads_back_scalars_images_and_hparams(tmp_path):
    rng = np.random.default_rng(0)
    losses = rng.uniform(0.1, 3.0, 4)
    pictures = rng.integers(0, 256, (2, 9, 7, 3), np.uint8)  # two images under one tag
    w = tensorboard.SummaryWriter(str(tmp_path))
    w.write_hparams({"model.depth": 4, "optimizer.learning_rate": 1e-3, "norm": "dtn", "ema": True})
    for i, loss in enumerate(losses):
        w.write_scalars(10 * i, {"train/loss": np.float32(loss), "train/step": i})
    w.write_images(20, {"attention/maps": pictures, "single": pictures[0]})
    w.close()
    (name,) = os.listdir(tmp_path)
    assert name.startswith("events.out.tfevents.")

    acc = _accumulator(str(tmp_path))
    assert _scalars(acc, "train/loss") == [(10 * i, float(np.float32(x)))  # float32, exactly
                                          for i, x in enumerate(losses)]
    assert _scalars(acc, "train/step") == [(10 * i, float(i)) for i in range(4)]
    # the images plugin's format: [width, height, png, png]
    (event,) = acc.Tensors("attention/maps")
    assert event.step == 20
    width, height, *pngs = event.tensor_proto.string_val
    assert (int(width), int(height)) == (7, 9) and len(pngs) == 2
    for png, expected in zip(pngs, pictures):
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(png))), expected)
    assert len(acc.Tensors("single")[0].tensor_proto.string_val) == 3
    assert acc.SummaryMetadata("attention/maps").plugin_data.plugin_name == "images"
    assert acc.SummaryMetadata("train/loss").plugin_data.plugin_name == "scalars"
    # hparams: the plugin's session-start record with every value
    from tensorboard.plugins.hparams import plugin_data_pb2
    content = acc.PluginTagToContent("hparams")
    (raw,) = content.values()
    start = plugin_data_pb2.HParamsPluginData.FromString(raw).session_start_info
    assert start.hparams["model.depth"].number_value == 4
    assert start.hparams["optimizer.learning_rate"].number_value == pytest.approx(1e-3)
    assert start.hparams["norm"].string_value == "dtn" and start.hparams["ema"].bool_value


def test_each_record_is_on_disk_as_it_is_written(tmp_path):
    """TensorBoard reads the file while the run goes on: a log step's scalars are readable before
    the writer is flushed or closed (they waited for the next checkpoint save: TensorBoard ~400
    steps behind the log on a slow CPU)."""
    from normvit_jax import summaries
    w = tensorboard.SummaryWriter(str(tmp_path))
    w.write_scalars(5, {"train/loss": 1.5})
    assert [p[:2] for p in summaries.read_scalars(str(tmp_path))["train/loss"]] == [(5, 1.5)]
    w.write_images(10, {"maps": np.zeros((4, 4, 3), np.uint8)})
    assert _accumulator(str(tmp_path)).Tensors("maps")[0].step == 10
    w.close()


def test_a_remote_event_file_is_not_flushed_per_record(tmp_path, monkeypatch):
    """On gs:// (tf.io.gfile) each flush uploads the whole file again: a flush per record
    re-uploaded it at every log step. Remote: flushed only after REMOTE_FLUSH_S seconds and by
    flush() (before each checkpoint); local paths keep a flush per record."""
    from normvit_jax import workdir
    now = [1000.0]
    monkeypatch.setattr(tensorboard.time, "monotonic", lambda: now[0])
    counts = {}
    for remote in (True, False):
        monkeypatch.setattr(workdir, "is_remote", lambda path, r=remote: r)
        w = tensorboard.SummaryWriter(str(tmp_path / str(remote)))
        flushes = []
        real_flush = w._records.flush
        monkeypatch.setattr(w._records, "flush", lambda f=flushes, r=real_flush: (f.append(1), r()))
        for step in range(5):
            w.write_scalars(step, {"train/loss": 1.0})
        counts[remote] = len(flushes)
        if remote:
            now[0] += tensorboard.REMOTE_FLUSH_S
            w.write_scalars(5, {"train/loss": 1.0})
            assert len(flushes) == 1
            w.flush()
            assert len(flushes) == 2
        w.close()
    assert counts == {True: 0, False: 5}


def test_images_must_be_uint8(tmp_path):
    w = tensorboard.SummaryWriter(str(tmp_path))
    with pytest.raises(ValueError, match="uint8"):
        w.write_images(0, {"x": np.zeros((4, 4, 3), np.float32)})
    w.close()


def test_a_training_run_writes_its_summaries_without_importing_tensorflow(tmp_path):
    """The loop on the bundled digits: no TensorFlow and no CLU writer imported, and TensorBoard
    reads the train and eval scalars at the logged steps."""
    code = textwrap.dedent(f"""
        import sys
        from tests.conftest import tiny_demo_config
        from normvit_jax.train import loop
        loop.train_and_evaluate(tiny_demo_config(), {str(tmp_path)!r})
        print(sorted(m for m in ('tensorflow', 'clu.metric_writers') if m in sys.modules))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout
    acc = _accumulator(str(tmp_path))
    assert [s for s, _ in _scalars(acc, "train/loss")] == [2, 4, 6]
    assert all(np.isfinite(v) for _, v in _scalars(acc, "train/loss"))
    assert [s for s, _ in _scalars(acc, "eval/top1")] == [6]

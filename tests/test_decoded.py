"""Issue 35, point 13: a prepared split that fits ``data.in_memory_mb`` is decoded once and
augmented from memory, giving the decoding path's batches bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from normvit_jax import data
from normvit_jax.data import decoded, prepare
from normvit_jax.data.sources import JpegSource
from tests.conftest import tiny_demo_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """src/<class>/: 6 images per class, 12x10 PNG and JPEG (one gray), tinted by class, 1/3 held
    out; prepared as 'tiny_mem'."""
    root = tmp_path_factory.mktemp("mem")
    rng = np.random.default_rng(2)
    for c in range(2):
        d = root / "src" / f"c{c}"
        d.mkdir(parents=True)
        for i in range(6):
            x = rng.integers(0, 150, (12, 10, 3)) + np.eye(3, dtype=int)[c] * 100
            img = Image.fromarray(x.astype(np.uint8))
            img = img.convert("L") if i == 0 else img
            img.save(d / (f"{i}.png" if i % 2 else f"{i}.jpg"), quality=90)
    prepare.main([f"--src={root}/src", "--name=tiny_mem", f"--data_dir={root}/dd",
                  "--val_fraction=0.34"])
    return root


def _config(root, **kw):
    base = {"data.name": "tiny_mem", "data.data_dir": f"{root}/dd", "data.image_size": 8,
            "data.crop_padding": 2, "data.flip": True, "data.num_workers": 1,
            "data.eval_crop_fraction": 0.9, "batch_size": 4, "eval_batch_size": 3}
    base.update(kw)
    return tiny_demo_config(**base)


def _pipelines(root, split, **kw):
    mem = data.make_pipeline(_config(root, **kw), split, process_index=0, process_count=1)
    off = data.make_pipeline(_config(root, **{**kw, "data.in_memory_mb": 0}), split,
                             process_index=0, process_count=1)
    return mem, off


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_train_and_eval_batches_are_the_decoding_paths_bit_for_bit(dataset, interpolation):
    kw = {"data.interpolation": interpolation}
    mem, off = _pipelines(dataset, "train", **kw)
    assert isinstance(mem.source, decoded.DecodedSource) and isinstance(off.source, JpegSource)
    flips = 0
    for step in range(6):  # two epochs: reshuffled rows, fresh draws
        a, b = mem.train_batch(step), off.train_batch(step)
        assert a["image"].dtype == np.uint8
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["label"], b["label"])
        flips += int(not np.array_equal(a["image"], a["image"][:, :, ::-1]))
    assert flips  # the augmentation did act
    mem, off = _pipelines(dataset, "eval", **kw)
    assert isinstance(mem.source, decoded.DecodedSource)
    for b in range(mem.steps_per_epoch):  # the last batch is padded
        x, y = mem.eval_batch(b), off.eval_batch(b)
        for key in ("image", "label", "mask"):
            np.testing.assert_array_equal(x[key], y[key])


def test_budget_and_drawn_first_stages_keep_the_decoding_path(dataset):
    # 8 train examples of 8x8x3 bytes: 0.00073 MiB
    small = _pipelines(dataset, "train", **{"data.in_memory_mb": 0.0007})[0]
    assert isinstance(small.source, JpegSource)
    for kw in ({"data.random_resized_crop": True}, {"data.interpolation": "random"}):
        mem, off = _pipelines(dataset, "train", **kw)
        assert isinstance(mem.source, JpegSource)
        np.testing.assert_array_equal(mem.train_batch(1)["image"], off.train_batch(1)["image"])
    # 'random' evaluates bicubic: the eval split is still decoded once
    assert isinstance(_pipelines(dataset, "eval", **{"data.interpolation": "random"})[0].source,
                      decoded.DecodedSource)


def test_a_train_pipeline_read_with_the_eval_geometry_decodes(dataset):
    mem, off = _pipelines(dataset, "train")
    np.testing.assert_array_equal(mem.eval_batch(1)["image"], off.eval_batch(1)["image"])


def test_the_analysis_probe_reads_its_few_images_without_decoding_the_split(dataset, monkeypatch):
    """The training loop's analysis probe (16 eval images) reads them as they come: it had
    decoded the whole eval split into memory a second time in every run."""
    from normvit_jax.analysis import capture
    made = []
    real = decoded.maybe_decode_once
    monkeypatch.setattr(decoded, "maybe_decode_once",
                        lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    config = _config(dataset)
    spec = data.resolve_data_spec(config)
    images, labels = capture.eval_images(config, spec, 2)
    assert len(made) == 1 and isinstance(made[0], JpegSource)
    assert config.data.in_memory_mb > 0  # the caller's config is left as it was
    mem = data.make_pipeline(config, "eval", spec, process_index=0, process_count=1)
    assert isinstance(mem.source, decoded.DecodedSource)
    batch = mem.eval_batch(0)
    from normvit_jax.data import stats as data_stats
    np.testing.assert_array_equal(images, data_stats.model_input(batch["image"][:2], spec.affine))
    np.testing.assert_array_equal(labels, batch["label"][:2])

"""Tests of normvit_jax.data: order, resume, host sharding, eval padding, sources, errors.

Offline only: sklearn's digits, ``tfds.testing.mock_data``, and tiny tfds datasets prepared here
from generated images (their split generators are patched, so nothing is downloaded).
"""
from __future__ import annotations

import dataclasses
import gc
import io
import itertools
import os
import re
import time
from unittest import mock

import numpy as np
import pytest

from configs import default
from normvit_jax import data
from normvit_jax.data import digits, order, stats, transforms
from normvit_jax.data.prefetch import Prefetcher

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")


def cfg(name: str = "digits", **over):
    """The demo config (digits at 8x8), with ``over`` applied to ``config.data``."""
    c = default.get_demo(default.get_config())
    c.data.name = name
    c.data.return_index = True
    for k, v in over.items():
        c.data[k] = v
    return c


def pipe(c, split: str = "train", i: int = 0, n: int = 1):
    return data.make_pipeline(c, split, process_index=i, process_count=n)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


# ---- spec ----

def test_num_classes():
    assert [data.num_classes(n) for n in ("digits", "cifar10", "cifar100", "imagenet2012")] == [
        10, 10, 100, 1000]
    with pytest.raises(ValueError, match="mnist.*accepted.*cifar10"):
        data.num_classes("mnist")


@pytest.mark.parametrize("key,value,words", [
    ("name", "mnist", ["data.name", "'mnist'", "cifar100", "digits"]),
    ("normalize", "bogus", ["data.normalize", "'bogus'", "zscore", "minus_one_one"]),
    ("image_size", 0, ["data.image_size", "0", ">= 1"]),
    ("eval_crop_fraction", 1.5, ["data.eval_crop_fraction", "1.5", "(0, 1]"]),
    ("crop_padding", -1, ["data.crop_padding", "-1"]),
    ("min_crop_area", 0.0, ["data.min_crop_area", "0.0", "(0, 1]"]),
    ("interpolation", "lanczos", ["data.interpolation", "'lanczos'", "bicubic"]),
])
def test_validate_rejects(key, value, words):
    c = cfg()
    c.data[key] = value
    with pytest.raises(ValueError) as e:
        data.validate(c)
    for w in words:
        assert w in str(e.value)


def test_a_new_uniform_column_leaves_the_earlier_draws():
    """Columns past the first 25 (transforms.U_INTERP) are drawn after them: existing runs'
    crops and flips are unchanged by the column 'random' interpolation added."""
    old = order.aug_uniforms(3, 17, 10, 25)
    new = order.aug_uniforms(3, 17, 10, transforms.NUM_UNIFORMS)
    assert transforms.NUM_UNIFORMS == 26
    np.testing.assert_array_equal(new[:, :25], old)
    assert 0.0 <= new[:, 25].min() and new[:, 25].max() < 1.0 and len(set(new[:, 25])) == 10


def test_validate_checks_batch_and_never_touches_disk(tmp_path):
    c = cfg("cifar10", data_dir=str(tmp_path / "missing"))
    data.validate(c)  # a good config passes without looking for the data
    assert not (tmp_path / "missing").exists()
    c.eval_batch_size = 0
    with pytest.raises(ValueError, match="eval_batch_size=0"):
        data.validate(c)
    with pytest.raises(ValueError, match="'test'"):
        pipe(cfg(), "test")
    with pytest.raises(ValueError, match="not divisible"):
        pipe(cfg(), "train", 0, 3)  # 64 rows over 3 processes
    big = cfg(num_train_examples=10)  # the key, its value and the bound, as every config check
    with pytest.raises(ValueError, match=r"^config.batch_size=64 is larger than the train split "
                                         r"\(digits:train, 10 examples\).*accepted: at most 10$"):
        pipe(big, "train")


def test_resolve_data_spec_is_the_config_resolved_once(tmp_path):
    """The DataSpec holds what the rest of the code used to re-derive from data.name: classes,
    shape, statistics, the affine (checked against the formula in float64), splits and sizes;
    it is frozen and hashable; resolving reads no tfds directory."""
    d = data.resolve_data_spec(cfg())
    x = digits.load("train")[0].astype(np.float64)
    assert (d.name, d.eval_name, d.train_split, d.eval_split) == ("digits", "digits", "train", "test")
    assert (d.num_classes, d.image_shape, d.num_train_examples, d.num_eval_examples) == (
        10, (8, 8, 3), 1442, 355)
    assert d.class_names == tuple("0123456789")
    np.testing.assert_allclose(d.mean, x.mean((0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(d.std, x.std((0, 1, 2)), rtol=1e-12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_classes = 3
    assert hash(d) == hash(data.resolve_data_spec(cfg()))
    for normalize, want in (("zscore", (1 / x.std((0, 1, 2)), -x.mean((0, 1, 2)) / x.std((0, 1, 2)))),
                            ("minus_one_one", (np.full(3, 2.0), np.full(3, -1.0))),
                            ("minmax", (1 / (x.max((0, 1, 2)) - x.min((0, 1, 2))),
                                        -x.min((0, 1, 2)) / (x.max((0, 1, 2)) - x.min((0, 1, 2)))))):
        scale, shift = data.resolve_data_spec(cfg(normalize=normalize)).affine
        assert scale.dtype == shift.dtype == np.float32
        np.testing.assert_allclose(scale, want[0], rtol=1e-6)
        np.testing.assert_allclose(shift, want[1], rtol=1e-6, atol=1e-7)
    c = cfg("cifar100", data_dir=str(tmp_path / "missing"), num_train_examples=500)
    d = data.resolve_data_spec(c)
    assert (d.num_classes, d.class_names, d.num_train_examples, d.num_eval_examples) == (
        100, None, 500, None)
    np.testing.assert_allclose(d.mean, [0.5071, 0.4865, 0.4409])
    assert d.data_dir == str(tmp_path / "missing") and not (tmp_path / "missing").exists()
    c = cfg("imagenet2012", eval_name="imagenet_v2", eval_split="test")
    d = data.resolve_data_spec(c)
    assert (d.name, d.eval_name, d.eval_split, d.num_classes) == (
        "imagenet2012", "imagenet_v2", "test", 1000)


@pytest.mark.parametrize("batch,eval_batch,accum,devices,words", [
    (0, 8, 1, 1, "config.batch_size=0"),
    (8, 8, 3, 1, "config.grad_accum_steps=3"),
    (12, 8, 1, 8, "config.batch_size=12 is not divisible by the number of devices (8)"),
    (40, 8, 2, 8, "config.batch_size / grad_accum_steps=20"),
    (16, 12, 1, 8, "config.eval_batch_size=12"),
])
def test_batch_sizes_are_checked_in_one_place(batch, eval_batch, accum, devices, words):
    c = cfg()
    c.batch_size, c.eval_batch_size, c.grad_accum_steps = batch, eval_batch, accum
    with pytest.raises(ValueError) as e:
        data.resolve_data_spec(c, devices)
    assert words in str(e.value)
    if batch and eval_batch:  # the same numbers pass on a device count they divide
        c.grad_accum_steps = 1
        data.check_batch_sizes(c, 4)


# ---- digits ----

def test_digits_split_is_fixed_and_stratified():
    xtr, ytr = digits.load("train")
    xte, yte = digits.load("test")
    assert (len(ytr), len(yte)) == (digits.NUM_TRAIN, digits.NUM_TEST) == (1442, 355)
    assert np.bincount(ytr).tolist() == [143, 146, 142, 147, 145, 146, 145, 144, 140, 144]
    assert np.bincount(yte).tolist() == [35, 36, 35, 36, 36, 36, 36, 35, 34, 36]
    assert xtr.shape == (1442, 8, 8, 3) and xtr.dtype == np.float32
    assert xtr.min() == 0.0 and xtr.max() == 1.0
    assert np.array_equal(xtr[..., 0], xtr[..., 2])  # gray in all channels
    p, e = pipe(cfg()), pipe(cfg(), "eval")
    assert (p.num_examples, e.num_examples, p.steps_per_epoch, e.steps_per_epoch) == (
        1442, 355, 1442 // 64, 3)
    assert (p.image_shape, p.global_batch_size, e.global_batch_size) == ((8, 8, 3), 64, 128)


def test_digits_are_scikit_learns_read_without_importing_it():
    """The bundled CSV read directly equals ``sklearn.datasets.load_digits`` (its own loader), and
    a fresh process loads the demo set without importing scikit-learn (~2 s per process)."""
    import subprocess
    import sys
    from sklearn.datasets import load_digits
    d = load_digits()
    images, target = digits._raw()
    assert digits._bundled_csv() is not None  # the fast path is the one tested here
    np.testing.assert_array_equal(images, d.images)
    np.testing.assert_array_equal(target.astype(int), d.target)
    code = ("import sys; from normvit_jax.data import digits; x, y = digits.load('train'); "
            "print(len(y), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1442", "False"], out


@pytest.mark.parametrize("normalize", data.NORMALIZE)
def test_value_range(normalize):
    # one pass over the training split, without augmentation, in split order
    c = cfg(normalize=normalize, eval_split="train")
    x = np.concatenate([b["image"][b["mask"] > 0] for b in pipe(c, "eval").eval_batches()])
    assert x.shape == (1442, 8, 8, 3) and x.dtype == np.float32
    lo, hi = x.min((0, 1, 2)), x.max((0, 1, 2))
    if normalize == "zero_one" or normalize == "minmax":
        np.testing.assert_allclose([lo, hi], [[0] * 3, [1] * 3], atol=1e-6)
    elif normalize == "minus_one_one":
        np.testing.assert_allclose([lo, hi], [[-1] * 3, [1] * 3], atol=1e-6)
    elif normalize == "imagenet":  # timm's IMAGENET_DEFAULT_MEAN/STD on digits (0..1 per channel)
        m, s = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        np.testing.assert_allclose([lo, hi], [-m / s, (1 - m) / s], atol=1e-6)
    else:
        x = x.astype(np.float64)  # float32 sums over 92k pixels drift in the 4th digit
        np.testing.assert_allclose(x.mean((0, 1, 2)), 0, atol=1e-5)
        np.testing.assert_allclose(x.std((0, 1, 2)), 1, atol=1e-5)


def test_dataset_stats():
    s = data.dataset_stats("digits")
    x = digits.load("train")[0].astype(np.float64)
    assert sorted(s) == ["max", "mean", "min", "std"]
    np.testing.assert_allclose(s["mean"], x.mean((0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(s["std"], x.std((0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(data.dataset_stats("cifar10")["mean"], [0.4914, 0.4822, 0.4465])
    assert data.dataset_stats("imagenet2012")["std"].shape == (3,)
    with pytest.raises(ValueError, match="accepted"):
        data.dataset_stats("svhn")


# ---- order, resume, hosts ----

def test_same_seed_same_batches_other_seed_other_order():
    a = list(itertools.islice(pipe(cfg()).train_batches(0), 3))
    b = list(itertools.islice(pipe(cfg()).train_batches(0), 3))
    assert all(same(x, y) for x, y in zip(a, b))
    c = cfg()
    c.seed = 1
    other = next(pipe(c).train_batches(0))
    assert not np.array_equal(a[0]["index"], other["index"])


def test_every_example_once_per_epoch():
    c = cfg(crop_padding=0)  # augmentation off: images can be compared with the source
    p = pipe(c)
    n, bs = p.num_examples, p.global_batch_size
    assert n % bs  # 1442 = 22 * 64 + 34: epochs straddle batches
    batches = list(itertools.islice(p.train_batches(0), 2 * n // bs + 1))
    stream = np.concatenate([b["index"] for b in batches])
    first, second = stream[:n], stream[n:2 * n]
    assert np.array_equal(np.sort(first), np.arange(n))  # each example exactly once in epoch 0
    within = np.concatenate([b["index"] for b in batches[:p.steps_per_epoch]])
    assert len(np.unique(within)) == len(within) == p.steps_per_epoch * bs
    assert np.array_equal(np.sort(second), np.arange(n))  # ... and again in epoch 1,
    assert not np.array_equal(first, second)               # in another order
    np.testing.assert_array_equal(first, order.permutation(c.seed, 0, n))
    x, y = digits.load("train")
    b = batches[22]  # the batch that straddles epochs 0 and 1
    np.testing.assert_array_equal(b["image"], x[b["index"]])
    np.testing.assert_array_equal(b["label"], y[b["index"]])


@pytest.mark.parametrize("aug", [dict(crop_padding=1, flip=True),
                                 dict(random_resized_crop=True, flip=True, image_size=12)])
def test_resume_is_bitwise_and_reads_nothing_skipped(aug):
    c = cfg(**aug)
    full = list(itertools.islice(pipe(c).train_batches(0), 7))[3:]
    resumed = list(itertools.islice(pipe(c).train_batches(3), 4))
    assert all(same(a, b) for a, b in zip(full, resumed))
    # augmentation really changed the pixels
    plain = pipe(cfg(crop_padding=0, image_size=c.data.image_size)).train_batch(3)
    assert np.array_equal(plain["index"], full[0]["index"])
    assert not np.array_equal(plain["image"], full[0]["image"])
    # resuming far away reads only the examples of the batch asked for (no read-ahead here)
    c.data.prefetch = 0
    p = pipe(c)
    with mock.patch.object(p.source, "read", wraps=p.source.read) as read:
        t = time.perf_counter()
        b = next(p.train_batches(1_000_000))
        assert time.perf_counter() - t < 2.0
    assert read.call_count == 1 and len(read.call_args[0][0]) == 64
    assert same(b, pipe(c).train_batch(1_000_000))


@pytest.mark.parametrize("procs", [2, 4])
def test_hosts_split_each_global_batch(procs):
    c = cfg(crop_padding=1, flip=True)
    single = pipe(c)
    hosts = [pipe(c, "train", i, procs) for i in range(procs)]
    assert all(h.local_batch_size == 64 // procs for h in hosts)
    for step in (0, 22, 23):
        parts = [h.train_batch(step) for h in hosts]
        merged = {k: np.concatenate([q[k] for q in parts]) for k in parts[0]}
        assert same(merged, single.train_batch(step))
    with mock.patch.object(hosts[1].source, "read", wraps=hosts[1].source.read) as read:
        hosts[1].train_batch(5)
    own = single.train_batch(5)["index"][64 // procs: 2 * 64 // procs]
    np.testing.assert_array_equal(read.call_args[0][0], own)  # reads only its own rows
    # eval: same batch count on every host, slices concatenate to the single-process batches
    ev = [list(pipe(c, "eval", i, procs).eval_batches()) for i in range(procs)]
    ref = list(pipe(c, "eval").eval_batches())
    assert {len(e) for e in ev} == {len(ref)} == {3}
    for j, r in enumerate(ref):
        assert same({k: np.concatenate([e[j][k] for e in ev]) for k in r}, r)


def test_eval_pads_and_masks():
    e = pipe(cfg(), "eval")  # 355 examples, batches of 128: 128 + 128 + 99 real, 29 padding
    batches = list(e.eval_batches())
    assert len(batches) == e.steps_per_epoch == 3
    assert all(b["image"].shape == (128, 8, 8, 3) for b in batches)
    mask = np.concatenate([b["mask"] for b in batches])
    idx = np.concatenate([b["index"] for b in batches])
    assert mask.dtype == np.float32 and mask.sum() == 355
    np.testing.assert_array_equal(np.sort(idx[mask == 1]), np.arange(355))
    assert np.all(idx[mask == 0] == -1) and np.all(batches[-1]["image"][99:] == 0)
    x, y = digits.load("test")
    np.testing.assert_array_equal(batches[1]["image"], x[128:256])
    np.testing.assert_array_equal(batches[1]["label"], y[128:256])
    small = pipe(cfg(num_eval_examples=50), "eval")
    assert small.num_examples == 50 and sum(b["mask"].sum() for b in small.eval_batches()) == 50


def test_default_process_is_jax_process():
    p = data.make_pipeline(cfg(), "train")
    assert p.local_batch_size == p.global_batch_size == 64


# ---- prefetch ----

def test_prefetch_runs_ahead_in_a_daemon_thread():
    made = []

    def gen():
        for i in itertools.count():
            made.append(i)
            yield i

    it = Prefetcher(gen, 2)
    assert it.thread.daemon and next(it) == 0
    deadline = time.time() + 2
    while len(made) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(made) >= 3  # produced ahead of the consumer
    it.close()
    assert not it.thread.is_alive()
    p = pipe(cfg())
    tb = p.train_batches(0)
    assert tb.thread is not None and tb.thread.daemon
    thread = tb.thread
    next(tb)
    del tb
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()  # a dropped iterator stops its thread


def test_prefetch_propagates_errors_and_sync_mode():
    def bad():
        yield 1
        raise RuntimeError("decode failed")

    it = Prefetcher(bad, 2)
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="decode failed"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    sync = Prefetcher(lambda: iter([1, 2]), 0)
    assert sync.thread is None and list(sync) == [1, 2]
    c = cfg(prefetch=0)
    assert same(next(pipe(c).train_batches(2)), pipe(cfg()).train_batch(2))


# ---- transforms ----

def test_resize_keeps_constants_and_ramps():
    x = np.full((2, 8, 8, 3), 0.25, np.float32)
    np.testing.assert_allclose(transforms.resize(x, 32), 0.25, rtol=1e-6)
    ramp = np.tile(np.arange(32, dtype=np.float32)[None, :, None, None], (1, 1, 32, 1))
    down = transforms.resize(ramp, 16)[0, :, 0, 0]
    # interior: the (antialiased, symmetric) filter gives the mean of each pair of rows
    np.testing.assert_allclose(down[1:-1], np.arange(1, 15) * 2 + 0.5, atol=1e-4)
    assert 0.5 < down[0] < 1.0  # at the border the filter is cut off and renormalized


# ---- tfds ----

def test_not_prepared_fails_fast_with_instructions(tmp_path):
    import tensorflow_datasets  # noqa: F401  (import time is not the check's time)
    from normvit_jax import logs
    logs.import_tensorflow_once()  # nor TensorFlow's, which the tfds source imports on first use
    for name, extra in (("cifar10", "tfds build cifar10"),
                        ("imagenet2012", "file_format=array_record")):
        t = time.perf_counter()
        with pytest.raises(data.DatasetNotFoundError) as e:
            pipe(cfg(name, data_dir=str(tmp_path)))
        assert time.perf_counter() - t < 1.0
        msg = str(e.value)
        for w in (repr(name), str(tmp_path), extra, "digits"):
            assert w in msg
        assert isinstance(e.value, ValueError)
    assert "manual" in msg
    assert not any(tmp_path.iterdir())  # nothing downloaded or created


@pytest.mark.parametrize("eval_name, split, manual", [
    ("imagenet_v2", "test", None), ("imagenet2012_real", "validation", "ILSVRC2012_img_val.tar")])
def test_eval_only_sets_not_prepared_say_how_to_build_them_readable(tmp_path, eval_name, split,
                                                                     manual):
    """They are read by index: the command given must build array_record (tfds's default,
    TFRecord, is refused next); ReaL needs ImageNet's validation tar placed by hand."""
    c = cfg("imagenet2012", data_dir=str(tmp_path), eval_name=eval_name, eval_split=split)
    with pytest.raises(data.DatasetNotFoundError) as e:
        pipe(c, "eval")
    msg = str(e.value)
    assert f"tfds build {eval_name} --data_dir={tmp_path} --file_format=array_record" in msg
    if manual:
        assert f"place {manual} in {tmp_path / 'downloads' / 'manual'}" in msg
    assert "\n" not in msg and not any(tmp_path.iterdir())


def test_cifar10_under_mock_data(tmp_path):
    import tensorflow_datasets as tfds
    c = cfg("cifar10", data_dir=str(tmp_path), image_size=16, normalize="minus_one_one",
            crop_padding=2, flip=True)
    c.batch_size, c.eval_batch_size = 16, 16
    with tfds.testing.mock_data(num_examples=40):
        p, e = pipe(c), pipe(c, "eval")
    assert (p.num_examples, p.steps_per_epoch, e.steps_per_epoch) == (40, 2, 3)
    b = next(p.train_batches(0))
    assert b["image"].shape == (16, 16, 16, 3) and b["image"].dtype == np.float32
    assert b["label"].dtype == np.int32 and 0 <= b["label"].min() <= b["label"].max() < 10
    assert -1 <= b["image"].min() < 0 < b["image"].max() <= 1
    assert sum(x["mask"].sum() for x in e.eval_batches()) == 40


def _prepare(name, root, file_format, splits):
    """Prepares a real tfds dataset in ``root`` from given examples, without downloading."""
    import tensorflow_datasets as tfds
    cls = type(tfds.builder(name, data_dir=root))

    def split_generators(self, dl_manager):
        return {s: ((f"{s}{i}", ex) for i, ex in enumerate(exs)) for s, exs in splits.items()}

    with mock.patch.object(cls, "_split_generators", split_generators):
        tfds.builder(name, data_dir=root, file_format=file_format).download_and_prepare()


def _jpeg(value: int, h: int, w: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), value, np.uint8)).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def fake_imagenet(tmp_path_factory):
    """ImageNet in array_record: constant-gray JPEGs of odd sizes, gray level = 12 * label."""
    root = str(tmp_path_factory.mktemp("imagenet"))

    def examples(n, off):
        return [{"image": _jpeg(12 * (i % 20), 20 + i % 7 * 5, 17 + i % 5 * 9), "label": i % 20,
                 "file_name": f"x{off + i}.JPEG"} for i in range(n)]

    _prepare("imagenet2012", root, "array_record",
             {"train": examples(24, 0), "validation": examples(7, 100)})
    return root


def test_imagenet_random_access(fake_imagenet):
    c = default.get_imagenet(default.get_config())
    c.data.data_dir, c.data.image_size, c.data.return_index = fake_imagenet, 16, True
    c.data.num_workers = 2
    c.batch_size, c.eval_batch_size = 8, 4
    p, e = pipe(c), pipe(c, "eval")
    assert (p.num_examples, e.num_examples, e.steps_per_epoch) == (24, 7, 2)
    assert p.source.examples is not None  # array_record: raw records, parsed by TF
    full = list(itertools.islice(p.train_batches(0), 5))
    for b in full:
        assert b["image"].shape == (8, 16, 16, 3) and b["image"].dtype == np.uint8
        # the crop of a constant image is constant: pixels must match the label they came with
        np.testing.assert_allclose(b["image"].mean((1, 2, 3)), 12 * b["label"], atol=3)
        x = stats.model_input(b["image"], stats.affine("imagenet2012", "minus_one_one"))
        assert x.dtype == np.float32 and -1 <= x.min() <= x.max() <= 1
    assert all(same(a, r) for a, r in zip(full[2:], itertools.islice(p.train_batches(2), 3)))
    halves = [pipe(c, "train", i, 2).train_batch(4) for i in range(2)]
    assert same({k: np.concatenate([h[k] for h in halves]) for k in full[4]}, full[4])
    ev = list(e.eval_batches())
    mask = np.concatenate([b["mask"] for b in ev])
    assert mask.tolist() == [1] * 7 + [0]
    assert sorted(np.concatenate([b["index"] for b in ev])[:7]) == list(range(7))
    ev_hosts = [list(pipe(c, "eval", i, 2).eval_batches()) for i in range(2)]
    assert [len(h) for h in ev_hosts] == [2, 2]
    assert np.concatenate([h[1]["mask"] for h in ev_hosts]).tolist() == [1, 1, 1, 0]
    p.close()


def _as_version(src_root: str, dst_root, version: str) -> str:
    """A copy of the prepared imagenet2012 in ``src_root`` relabelled as ``version`` (what an
    older tfds left), in ``dst_root``."""
    import json
    import shutil
    (src,) = [d for d in os.listdir(os.path.join(src_root, "imagenet2012")) if d[0].isdigit()]
    dst = os.path.join(dst_root, "imagenet2012", version)
    shutil.copytree(os.path.join(src_root, "imagenet2012", src), dst)
    info = os.path.join(dst, "dataset_info.json")
    with open(info) as f:
        d = json.load(f)
    d["version"] = version
    with open(info, "w") as f:
        json.dump(d, f)
    return str(dst_root)


def test_imagenet_built_by_an_older_tfds_is_read_not_rebuilt(fake_imagenet, tmp_path):
    """ImageNet prepared as 5.0.0 (tfds's default before 5.1.0 added the unlabelled 'test'):
    read as it is. Another major version is not read, and the message names it."""
    c = default.get_imagenet(default.get_config())
    c.data.data_dir, c.data.image_size, c.data.num_workers = (
        _as_version(fake_imagenet, tmp_path / "old", "5.0.0"), 16, 2)
    c.batch_size, c.eval_batch_size = 8, 4
    new = default.get_imagenet(default.get_config())
    new.data.data_dir, new.data.image_size, new.data.num_workers = fake_imagenet, 16, 2
    new.batch_size, new.eval_batch_size = 8, 4
    assert same(pipe(c).train_batch(3), pipe(new).train_batch(3))
    assert pipe(c, "eval").num_examples == 7
    c.data.data_dir = _as_version(fake_imagenet, tmp_path / "older", "4.0.0")
    with pytest.raises(data.DatasetNotFoundError,
                       match=r"other versions there, which this tfds does not read: 4\.0\.0"):
        pipe(c)


def test_imagenet_tfrecord_is_refused_with_a_fix(tmp_path):
    _prepare("imagenet2012", str(tmp_path), "tfrecord",
             {"validation": [{"image": _jpeg(0, 9, 9), "label": 1, "file_name": "a.JPEG"}]})
    c = cfg("imagenet2012", data_dir=str(tmp_path), eval_split="validation")
    with pytest.raises(data.DatasetNotFoundError, match="convert_format.*array_record"):
        pipe(c, "eval")


@pytest.mark.parametrize("key, split", [("eval_split", "test"), ("eval_split", "validation+test"),
                                        ("train_split", "test[:50%]"), ("train_split", "all")])
def test_imagenet_unlabelled_test_split_is_refused_when_opened(fake_imagenet, key, split):
    """tfds's imagenet2012 'test' has label -1 everywhere: evaluated, it reported loss 0.0 and
    top-1 0%. Opening it is refused in one line; resolving the config (predict, export of a
    run whose config names it) is not. tfds's 'all' reads it too (it was let through: 100,000
    examples of loss 0 mixed into training)."""
    c = default.get_imagenet(default.get_config())
    c.data.data_dir, c.data[key] = fake_imagenet, split
    data.resolve_data_spec(c)
    with pytest.raises(ValueError, match=rf"^config.data.{key}='{re.escape(split)}' is invalid; "
                                         r"accepted: a labelled split of 'imagenet2012'.*'validation'"):
        pipe(c, "train" if key == "train_split" else "eval")


@pytest.mark.parametrize("key, split, why", [
    ("eval_split", "val", "Unknown split 'val'"),
    ("train_split", "train[:200%]", "percent slice boundaries should be in"),
    ("train_split", "train[5:3]", "the slice selects no examples")])
def test_a_split_tfds_cannot_read_is_one_line_naming_its_key(fake_imagenet, key, split, why):
    """tfds's own messages named neither the key nor (some) fit one line ('train[5:3]' read
    '__len__() should return >= 0')."""
    c = default.get_imagenet(default.get_config())
    c.data.data_dir, c.data[key] = fake_imagenet, split
    with pytest.raises(ValueError) as e:
        pipe(c, "train" if key == "train_split" else "eval")
    msg = str(e.value)
    assert msg.startswith(f"config.data.{key}={split!r} cannot be read from imagenet2012: ")
    assert why in msg and "\n" not in msg


def test_cifar10_prepared_array_record_in_memory(tmp_path):
    ex = [{"id": f"i{i}", "image": np.full((32, 32, 3), 20 * (i % 10), np.uint8),
           "label": i % 10} for i in range(12)]
    _prepare("cifar10", str(tmp_path), "array_record", {"train": ex, "test": ex[:5]})
    c = cfg("cifar10", data_dir=str(tmp_path), image_size=32, crop_padding=0, flip=False,
            normalize="zero_one")
    c.batch_size = 4
    p = pipe(c)
    assert p.num_examples == 12 and p.steps_per_epoch == 3
    b = p.train_batch(1)
    np.testing.assert_array_equal(b["image"], np.broadcast_to(
        (20 * b["label"] / 255).astype(np.float32)[:, None, None, None], (4, 32, 32, 3)))
    assert pipe(c, "eval").num_examples == 5
    # tfds cannot slice 'all' (its NotImplementedError was a traceback): one line naming the key
    c.data.train_split = "all[:50%]"
    with pytest.raises(ValueError) as e:
        pipe(c)
    assert str(e.value).startswith("config.data.train_split='all[:50%]' cannot be read from "
                                   "cifar10: ") and "\n" not in str(e.value)


def test_loop_trains_on_jpegs_and_resumes_bitwise(fake_imagenet, tmp_path):
    """The whole loop on array_record JPEGs (uint8 batches mapped in the step, RandAugment on):
    4 steps straight == 2, stop, 2 more; the eval sees each of the 7 validation images once."""
    import jax
    from normvit_jax import checkpoints
    from normvit_jax.train import loop
    from tests.conftest import tiny_demo_config
    c = tiny_demo_config(total_steps=4, checkpoint_every=100, eval_every=100, batch_size=8,
                         eval_batch_size=8, randaugment="rand-m9-mstd0.5-inc1")
    d = c.data
    d.name, d.data_dir, d.eval_split, d.image_size, d.num_workers = (
        "imagenet2012", fake_imagenet, "validation", 16, 2)
    d.random_resized_crop, d.flip, d.normalize = True, True, "zscore"
    straight = loop.train_and_evaluate(c, str(tmp_path / "a"))
    assert straight["eval"]["num_examples"] == 7 and np.isfinite(straight["eval"]["loss"])
    assert loop.train_and_evaluate(c, str(tmp_path / "b"), stop_at=2)["step"] == 2
    assert loop.train_and_evaluate(c, str(tmp_path / "b"))["step"] == 4
    a, _ = checkpoints.load_params(str(tmp_path / "a"))
    b, _ = checkpoints.load_params(str(tmp_path / "b"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs CPU affinity and 2+ cores")
def test_default_workers_follow_the_cores_this_process_may_use():
    """A process restricted to fewer CPUs than the machine has (SLURM, cgroups) decodes with that
    many threads, not one per CPU of the machine."""
    from normvit_jax.data import pipeline as pipeline_lib
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert pipeline_lib.usable_cores() == [min(before)]
        assert pipeline_lib.default_num_workers() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert pipeline_lib.default_num_workers() == min(32, len(before))


def test_a_misspelt_prepared_name_is_guessed_and_the_prepared_ones_are_listed(tmp_path):
    """--config.data.name=my_fmm listed the built-ins only, not the prepared 'my_fm' beside it."""
    for name in ("my_fm", "pets"):
        (tmp_path / name / "1.0.0").mkdir(parents=True)
        (tmp_path / name / "1.0.0" / "prepare.json").write_text("{}")
    (tmp_path / "half" / "1.0.0").mkdir(parents=True)  # not complete: not prepared
    with pytest.raises(data.DatasetNotFoundError) as e:
        data.dataspec.check_name("my_fmm", str(tmp_path))
    msg = str(e.value)
    assert "config.data.name='my_fmm' is not a known dataset (did you mean 'my_fm'?); " in msg
    assert f"({tmp_path}, which holds 'my_fm', 'pets')" in msg and "half" not in msg
    with pytest.raises(data.DatasetNotFoundError, match=r"which holds none\)"):
        data.dataspec.check_name("my_fm", str(tmp_path / "empty"))

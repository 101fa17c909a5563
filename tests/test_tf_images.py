"""The JPEG path of the input pipeline (data/tf_images.py, tf.data + TF image ops) against numpy and
PIL references; uint8 batches mapped to model input on the device; ordered concurrent batches."""
from __future__ import annotations

import dataclasses
import io
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

tf = pytest.importorskip("tensorflow")
from PIL import Image  # noqa: E402

from normvit_jax import models  # noqa: E402
from normvit_jax.data import order, stats, tf_images, transforms  # noqa: E402
from normvit_jax.data.prefetch import ordered_map  # noqa: E402
from normvit_jax.data.sources import Geometry  # noqa: E402
from normvit_jax.train import steps as steps_lib  # noqa: E402
from normvit_jax.train.state import TrainState  # noqa: E402


def _photo(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth random colours plus grain: structure at every scale, so a wrong window shows."""
    small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR), np.float32)
    return np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)


def _encode(img: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _numpy_reference(img: np.ndarray, u: np.ndarray, geo: Geometry) -> np.ndarray:
    """The in-memory source's numpy path on an already decoded image, rounded to uint8."""
    h, w = img.shape[:2]
    box = (transforms.random_resized_box(h, w, u, geo.min_area) if geo.rrc
           else transforms.central_box(h, w, geo.fraction))
    left, top, right, bottom = box
    x = transforms.resize(img[top:bottom, left:right].astype(np.float32), geo.size, geo.antialias,
                          transforms.pick_interpolation(geo.interpolation, u))
    x = np.clip(np.round(x), 0, 255)
    x = transforms.pad_crop_flip(x[None], u[None], geo.padding, geo.flip)[0]
    return x.astype(np.uint8)


@pytest.mark.parametrize("rrc,min_area,fraction", [(True, 0.08, 1.0), (True, 0.5, 1.0),
                                                   (False, 1.0, 0.875), (False, 1.0, 1.0)])
def test_crop_window_is_the_numpy_rule(rrc, min_area, fraction):
    geo = Geometry(32, rrc, min_area, fraction)
    rng = np.random.default_rng(1)
    n = 400
    hw = np.concatenate([rng.integers(1, 12, (n // 4, 2)), rng.integers(12, 700, (n - n // 4, 2))])
    u = rng.random((n, transforms.NUM_UNIFORMS))
    fn = tf.function(lambda h, w, r: tf_images.crop_window(h, w, r, geo))
    hw[: n // 8, 0] = rng.integers(1, 40, n // 8)  # 5:1 and thinner: timm's fallback, narrowed
    fallbacks = 0
    for (h, w), r in zip(hw, u):
        top, left, hh, ww = fn(tf.constant(h), tf.constant(w), tf.constant(r)).numpy().tolist()
        if rrc:
            box = transforms.random_resized_box(int(h), int(w), r, min_area)
            fallbacks += box == transforms.rrc_fallback_box(int(h), int(w))
        else:
            box = transforms.central_box(int(h), int(w), fraction)
        assert (left, top, left + ww, top + hh) == box, (h, w)
    if rrc:  # the tiny and thin images exercise the fallback, the rest the random boxes
        assert 0 < fallbacks < n * 3 // 4


def _timm_rrc(h: int, w: int, u: np.ndarray, min_area: float) -> tuple[int, int, int, int]:
    """timm's RandomResizedCropAndInterpolation.get_params (timm/data/transforms.py), its
    random.uniform/randint replaced by the same uniforms; (left, top, right, bottom)."""
    area, ratio = h * w, (3. / 4., 4. / 3.)
    for k in range(10):
        target_area = (min_area + (1.0 - min_area) * u[transforms.U_RRC + 2 * k]) * area
        log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0])
                                * u[transforms.U_RRC + 2 * k + 1])
        cw = int(round(math.sqrt(target_area * aspect_ratio)))
        ch = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(u[transforms.U_POS_Y] * (h - ch + 1))
            j = int(u[transforms.U_POS_X] * (w - cw + 1))
            return j, i, j + cw, i + ch
    in_ratio = w / h  # fallback to central crop
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        ch, cw = h, int(round(h * max(ratio)))
    else:  # whole image
        cw, ch = w, h
    i, j = (h - ch) // 2, (w - cw) // 2
    return j, i, j + cw, i + ch


def test_random_resized_box_is_timms_including_its_fallback():
    """A panorama (5:1 and 1:5) falls back in about a quarter of its draws: timm then takes its
    central 4:3 (3:4) window, not a square; photos within the limits take the whole image."""
    rng = np.random.default_rng(4)
    shapes = [(200, 1000), (1000, 200), (300, 600), (375, 500), (500, 375), (7, 3), (1, 1)]
    fell = 0
    for h, w in shapes:
        for _ in range(400):
            r = rng.random(transforms.NUM_UNIFORMS)
            box = transforms.random_resized_box(h, w, r, 0.08)
            assert box == _timm_rrc(h, w, r, 0.08), (h, w)
            fell += h * w == 200_000 and box == transforms.rrc_fallback_box(h, w)
    assert 100 < fell < 300  # of the panoramas' 800 draws (measured: about 24%)
    assert transforms.rrc_fallback_box(200, 1000) == (366, 0, 633, 200)  # 267 x 200, centred
    assert transforms.rrc_fallback_box(375, 500) == (0, 0, 500, 375)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "random"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("train", [True, False])
def test_lossless_images_match_the_numpy_path(antialias, train, interpolation):
    """PNG input: TF's window, resize, pad-crop and flip against the numpy path, pixel for pixel
    up to one level of rounding (float32 sums in another order)."""
    rng = np.random.default_rng(2)
    geo = (Geometry(24, True, 0.08, 1.0, 3, True, antialias, interpolation) if train
           else Geometry(24, False, 1.0, 0.875, antialias=antialias, interpolation=interpolation))
    imgs = [_photo(rng, int(rng.integers(10, 90)), int(rng.integers(10, 90))) for _ in range(12)]
    u = order.aug_uniforms(5, 3, len(imgs), transforms.NUM_UNIFORMS)
    out, _ = tf_images.BatchDecoder(2)([_encode(i, "PNG") for i in imgs], u if train else None,
                                       geo)
    assert out.dtype == np.uint8 and out.shape == (12, 24, 24, 3)
    # evaluation has no draws: 'random' is bicubic there (pick_interpolation)
    eval_geo = dataclasses.replace(
        geo, interpolation=transforms.pick_interpolation(geo.interpolation, None))
    ref = np.stack([_numpy_reference(i, u[k], geo) if train
                    else _numpy_reference(i, np.zeros_like(u[k]), eval_geo)
                    for k, i in enumerate(imgs)])
    diff = np.abs(out.astype(int) - ref.astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.05, (diff.max(), diff.mean())
    if train:  # the draws did something: some rows flipped, some not (some bilinear, some not)
        assert 0 < (u[:, transforms.U_FLIP] < 0.5).sum() < len(imgs)
        assert 0 < (u[:, transforms.U_INTERP] < 0.5).sum() < len(imgs)
    if interpolation == "random":  # each row is its own filter's resize, not the other's
        for fixed in ("bilinear", "bicubic"):
            one, _ = tf_images.BatchDecoder(2)([_encode(i, "PNG") for i in imgs], u if train else None,
                                               dataclasses.replace(geo, interpolation=fixed))
            same = [np.array_equal(a, b) for a, b in zip(out, one)]
            want = ([(r[transforms.U_INTERP] < 0.5) == (fixed == "bilinear") for r in u] if train
                    else [fixed == "bicubic"] * len(imgs))
            assert same == want


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("shape,size", [((61, 47), 24), ((13, 19), 40)])  # shrink, enlarge
def test_numpy_resize_is_pils(interpolation, shape, size):
    """transforms.resize (antialias on) against PIL's Image.resize (timm's and DeiT's) on float
    ('F' mode) channels of a random photo. PIL's uint8 mode rounds between its horizontal and
    vertical passes (up to ~3 levels off a single rounding); the filters are what is compared."""
    img = _photo(np.random.default_rng(4), *shape).astype(np.float32)
    flt = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
    pil = lambda f: np.stack([np.asarray(Image.fromarray(img[..., c], mode="F").resize((size, size), f))
                              for c in range(3)], -1)
    ours = transforms.resize(img, size, True, interpolation)
    np.testing.assert_allclose(ours, pil(flt[interpolation]), rtol=0, atol=1e-3)
    other = "bicubic" if interpolation == "bilinear" else "bilinear"  # the check can tell them apart
    assert np.abs(transforms.resize(img, size, True, other) - pil(flt[interpolation])).max() > 1


def test_jpeg_window_decode_matches_pil():
    """JPEG: decoding only the window (accurate IDCT) gives PIL's full decode cut to the same
    window, then the numpy path: equal up to one level of rounding, as for lossless input,
    except a few pixels at the window's edge (chroma upsampling sees no neighbours there)."""
    rng = np.random.default_rng(3)
    geo = Geometry(40, True, 0.08, 1.0, 0, True, True)
    imgs = [_photo(rng, int(rng.integers(60, 200)), int(rng.integers(60, 200))) for _ in range(10)]
    jpegs = [_encode(i, "JPEG") for i in imgs]
    u = order.aug_uniforms(7, 0, len(imgs), transforms.NUM_UNIFORMS)
    out = tf_images.BatchDecoder(2)(jpegs, u, geo)[0].astype(int)
    ref = np.stack([_numpy_reference(np.asarray(Image.open(io.BytesIO(j)).convert("RGB")), u[k],
                                     geo) for k, j in enumerate(jpegs)]).astype(int)
    diff = np.abs(out - ref)
    assert diff.mean() < 0.05 and np.mean(diff > 1) < 0.005, (diff.mean(), np.mean(diff > 1))
    # a window one row off would be far worse on these textures
    assert np.abs(out[:, 1:] - ref[:, :-1]).mean() > 1.0


def test_threads_do_not_change_the_batch():
    rng = np.random.default_rng(4)
    jpegs = [_encode(_photo(rng, 50 + k, 70 - k), "JPEG") for k in range(16)]
    u = order.aug_uniforms(0, 9, 16, transforms.NUM_UNIFORMS)
    geo = Geometry(16, True, 0.08, 1.0, 0, True, False)
    one, _ = tf_images.BatchDecoder(1)(jpegs, u, geo)
    four, _ = tf_images.BatchDecoder(4)(jpegs, u, geo)
    np.testing.assert_array_equal(one, four)
    assert tf_images.BatchDecoder(2)([], None, geo)[0].shape == (0, 16, 16, 3)


def test_serialized_examples_are_parsed_in_the_graph():
    """tfds's array_record records (tf.train.Example): image and label parsed by TF give what the
    decoded-record path gives."""
    rng = np.random.default_rng(8)
    jpegs = [_encode(_photo(rng, 40 + k, 30 + 2 * k), "JPEG") for k in range(6)]
    labels = [7, 0, 999, 3, 512, 1]
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[j])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
        "file_name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x.JPEG"]))}))
        .SerializeToString() for j, y in zip(jpegs, labels)]
    geo = Geometry(16, True, 0.08, 1.0, 0, True, True)
    u = order.aug_uniforms(1, 2, 6, transforms.NUM_UNIFORMS)
    dec = tf_images.BatchDecoder(2)
    x, y = dec(examples, u, geo, examples=True)
    assert y.dtype == np.int32 and y.tolist() == labels
    np.testing.assert_array_equal(x, dec(jpegs, u, geo)[0])


def test_model_input_maps_uint8_as_the_host_path():
    rng = np.random.default_rng(5)
    px = rng.integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    for normalize in ("minus_one_one", "zscore"):
        aff = stats.affine("imagenet2012", normalize)
        host = ((px.astype(np.float32) / 255.0) * aff[0] + aff[1]).astype(np.float32)
        np.testing.assert_allclose(stats.model_input(px, aff), host, rtol=0, atol=1e-6)
        dev = jax.jit(lambda x, aff=aff: stats.model_input(x, aff))(jnp.asarray(px))
        assert dev.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(dev), host, rtol=0, atol=1e-6)
    assert stats.model_input(host, None) is host  # float images are model input already
    with pytest.raises(ValueError, match="uint8 images need"):
        stats.model_input(px, None)


def test_train_and_eval_steps_take_uint8_batches():
    """A uint8 batch through the steps (mapped on the device) equals its float32 host mapping."""
    mdl = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                         "mlp_dim": 32, "norm": {"name": "layernorm"}}, 4)
    tx = optax.adamw(1e-3)
    v = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    state = TrainState.create(v["params"], {}, tx, jax.random.key_data(jax.random.key(1)))
    rng = np.random.default_rng(6)
    px = rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    aff = stats.affine("imagenet2012", "zscore")
    labels = np.arange(4, dtype=np.int32)
    host = stats.model_input(px, aff)
    lr = optax.constant_schedule(1e-3)
    step_u8 = jax.jit(steps_lib.make_train_step(mdl, tx, lr, input_affine=aff))
    step_f32 = jax.jit(steps_lib.make_train_step(mdl, tx, lr))
    _, m_u8 = step_u8(state, {"image": px, "label": labels})
    _, m_f32 = step_f32(state, {"image": host, "label": labels})
    np.testing.assert_allclose(m_u8.compute()["loss"], m_f32.compute()["loss"], rtol=1e-6)
    mask = np.ones(4, np.float32)
    ev = jax.jit(steps_lib.make_eval_step(mdl, aff))(state, {"image": px, "label": labels,
                                                            "mask": mask})
    ev_f = jax.jit(steps_lib.make_eval_step(mdl))(state, {"image": host, "label": labels,
                                                         "mask": mask})
    np.testing.assert_allclose(ev.compute()["loss"], ev_f.compute()["loss"], rtol=1e-6)


def test_ordered_map_runs_calls_at_once_and_keeps_order():
    lock, running, peak = threading.Lock(), [0], [0]

    def slow_square(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02 * (3 - i % 3))  # later calls finish first
        with lock:
            running[0] -= 1
        return i * i

    assert list(ordered_map(slow_square, range(9), 3)) == [i * i for i in range(9)]
    assert peak[0] >= 2
    assert list(ordered_map(slow_square, range(4), 1)) == [0, 1, 4, 9]

    def fail_at_2(i: int) -> int:
        if i == 2:
            raise RuntimeError("bad record 2")
        return i

    it = ordered_map(fail_at_2, range(6), 2)
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(RuntimeError, match="bad record 2"):
        next(it)
    endless = ordered_map(lambda i: i, iter(int, 1), 2)  # an infinite input, closed early
    assert next(endless) == 0
    endless.close()


def test_an_undecodable_image_is_named_by_its_index():
    from normvit_jax.data.sources import JpegSource
    rng = np.random.default_rng(9)
    good = _encode(_photo(rng, 30, 30), "JPEG")
    records = [{"image": good, "label": 1}] * 5
    records[3] = {"image": good[:200], "label": 2}  # a truncated file
    src = JpegSource(records, 5, 2)
    geo = Geometry(8, False, 1.0, 1.0)
    with pytest.raises(ValueError, match="example 3 of the split cannot be decoded"):
        src.read(np.arange(5), None, geo, stats.affine("imagenet2012", "zscore"))
    x, y = src.read(np.array([0, 4]), None, geo, stats.affine("imagenet2012", "zscore"))
    assert x.shape == (2, 8, 8, 3) and y.tolist() == [1, 1]


def test_concurrent_first_batches_trace_once_without_a_retracing_warning(caplog):
    """Issue 35, item 6: the batches in flight (4 threads) asked for the decoder at once and TF's
    frequent-tracing detector warned of "retracing" on every training run on a prepared dataset."""
    rng = np.random.default_rng(3)
    enc = [_encode(_photo(rng, 20 + i, 24), "PNG") for i in range(3)]
    geo = Geometry(12, False, 1.0, 1.0, padding=1, flip=True, antialias=False)  # a key of its own
    dec = tf_images.BatchDecoder(2)
    u = rng.uniform(size=(3, transforms.NUM_UNIFORMS))
    threads = [threading.Thread(target=lambda: [dec(enc, u, geo, examples=False) for _ in range(3)])
               for _ in range(6)]
    with caplog.at_level("WARNING"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert dec._fn(geo, False).experimental_get_tracing_count() == 1
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]


def test_an_undecodable_record_names_its_split_file_and_the_fix():
    """Training stopped with 'example 3 of the split cannot be decoded: Graph execution error:'
    naming neither the dataset's split, the file (a record holding its name) nor what to do."""
    import tensorflow as tf
    from normvit_jax.data.sources import JpegSource
    rng = np.random.default_rng(9)
    good = _encode(_photo(rng, 30, 30), "JPEG")

    def example(image: bytes, name: bytes) -> bytes:
        f = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
             "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
             "file_name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[name]))}
        return tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()

    class Records(list):
        def __getitems__(self, keys):
            return [self[k] for k in keys]

    recs = Records(example(good, f"{i}.jpg".encode()) for i in range(5))
    recs[3] = example(good[:200], b"cats/IMG_3.jpg")
    src = JpegSource(None, 5, 2, examples=recs, where="my_photos:train")
    with pytest.raises(ValueError) as e:
        src.read(np.arange(5), None, Geometry(8, False, 1.0, 1.0),
                 stats.affine("imagenet2012", "zscore"))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("example 3 of my_photos:train (file cats/IMG_3.jpg) cannot be decoded")
    assert "normvit_jax.data.prepare" in line and "--overwrite" in line and "remove" in line

"""RandAugment on device: every op against PIL (what timm calls) or TF's image ops (what big_vision
runs) on random uint8 images with fixed seeds, the magnitude mapping against timm's and big_vision's
published formulas, the sampling, the normalization round trip, the wiring into the train step."""
from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from normvit_jax import data
from normvit_jax.data import stats as data_stats
from normvit_jax.train import batch_aug, erasing, randaugment as ra
from normvit_jax.train import randaug_ops as ops
from normvit_jax.train import steps as steps_lib
from tests.conftest import tiny_demo_config

TIMM = ra.parse("rand-m9-mstd0.5-inc1")
BV = ra.parse("bigvision-2-10")
FILL = (125.0, 123.0, 114.0)


def _images(seed: int, n: int = 3, size: tuple[int, int] = (32, 28)) -> list[np.ndarray]:
    """Random uint8 RGB images, non-square so that x/y mix-ups show; every other one low-contrast
    (a narrow value range) so AutoContrast and Equalize have work to do."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = rng.integers(0, 256, size + (3,))
        out.append((a // 4 + 60 if i % 2 else a).astype(np.uint8))
    return out


def _diff(ours, ref) -> np.ndarray:
    return np.abs(np.asarray(ours, np.int64) - np.asarray(ref, np.int64))


def _f(a: np.ndarray) -> jax.Array:
    return jnp.asarray(a, jnp.float32)


# ----------------------------------------------------------------------------- pixel ops vs PIL

def test_point_ops_match_pil_exactly():
    """LUT ops are integer maps: exact."""
    for a in _images(0, 4):
        im, x = Image.fromarray(a), _f(a)
        np.testing.assert_array_equal(ops.invert(x), ImageOps.invert(im))
        for bits in range(9):  # timm skips bits >= 8; PIL >= 10 rejects 0, which timm's
            # PosterizeIncreasing reaches at level 10: PIL's own LUT ~(2^(8-bits) - 1) & i is all 0
            ref = (im if bits >= 8 else ImageOps.posterize(im, bits) if bits else
                   im.point([~(2 ** 8 - 1) & i for i in range(256)] * 3))
            np.testing.assert_array_equal(ops.posterize(x, jnp.float32(bits)), ref)
        for t in (0, 1, 77, 128, 255, 256):
            np.testing.assert_array_equal(ops.solarize(x, jnp.float32(t)), ImageOps.solarize(im, t))
        for add in (0, 33, 110, 128):  # timm's solarize_add: a LUT applied with Image.point
            lut = [min(255, i + add) if i < 128 else i for i in range(256)]
            np.testing.assert_array_equal(ops.solarize_add(x, jnp.float32(add)), im.point(lut * 3))
        np.testing.assert_array_equal(ops.autocontrast(x), ImageOps.autocontrast(im))
        np.testing.assert_array_equal(ops.equalize(x), ImageOps.equalize(im))
        np.testing.assert_array_equal(ops.grey(x)[..., 0], im.convert("L"))


def test_autocontrast_and_equalize_degenerate_channels_match_pil():
    a = _images(1, 1)[0]
    a[..., 1] = 7          # constant channel: identity in both
    a[:5, :, 2] = 200      # a channel with two values
    a[5:, :, 2] = 3
    im, x = Image.fromarray(a), _f(a)
    np.testing.assert_array_equal(ops.autocontrast(x), ImageOps.autocontrast(im))
    np.testing.assert_array_equal(ops.equalize(x), ImageOps.equalize(im))


@pytest.mark.parametrize("name", ["Color", "Contrast", "Brightness", "Sharpness"])
def test_enhance_ops_match_pil(name):
    """ImageEnhance blends with PIL's float arithmetic then truncates; XLA may round the float32
    product differently where the true value is an integer, so we allow 1 level on <= 1% of pixels
    (measured: exact on these seeds)."""
    fn = {"Color": ops.color, "Contrast": ops.contrast, "Brightness": ops.brightness,
          "Sharpness": ops.sharpness}[name]
    for a in _images(2, 4):
        im, x = Image.fromarray(a), _f(a)
        for factor in (0.0, 0.1, 0.55, 1.0, 1.37, 1.9):
            d = _diff(fn(x, jnp.float32(factor)), getattr(ImageEnhance, name)(im).enhance(factor))
            assert d.max() <= 1 and (d > 0).mean() <= 0.01, (factor, d.max(), (d > 0).mean())
    np.testing.assert_array_equal(ops.sharpness(x, jnp.float32(0.0)), im.filter(ImageFilter.SMOOTH))


def _timm_geometric(im: Image.Image, name: str, arg: float) -> Image.Image:
    """timm's auto_augment ops (PIL >= 5.2 branch), bilinear, fill = img_mean."""
    kw = dict(resample=Image.BILINEAR, fillcolor=tuple(int(v) for v in FILL))
    if name == "Rotate":
        return im.rotate(arg, **kw)
    m = {"ShearX": (1, arg, 0, 0, 1, 0), "ShearY": (1, 0, 0, arg, 1, 0),
         "TranslateXRel": (1, 0, arg * im.size[0], 0, 1, 0),
         "TranslateYRel": (1, 0, 0, 0, 1, arg * im.size[1])}[name]
    return im.transform(im.size, Image.AFFINE, m, **kw)


@pytest.mark.parametrize("name", ["Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"])
def test_timm_geometric_ops_match_pil(name):
    """Through ``apply_op`` (level -> argument -> matrix -> bilinear sampler). PIL computes source
    coordinates in float64 and we in float32: a weight can differ by ~1e-6, which moves a truncated
    value by 1 where it sits on an integer; allowed on <= 5% of pixels (measured <= 3.6%). A
    misplaced edge or fill would show as differences far above 1 on random content."""
    cfg = dataclasses.replace(TIMM, fill=FILL)
    for a in _images(3, 3):
        im, x = Image.fromarray(a), _f(a)
        for level, sign in ((9.0, 1.0), (6.3, -1.0), (10.0, -1.0)):
            arg = float(ra.level_to_arg("timm", name, jnp.float32(level), jnp.float32(sign)))
            ours = ra.apply_op(cfg, name, x, jnp.float32(level), jnp.float32(sign),
                               jax.random.key(0))
            d = _diff(ours, _timm_geometric(im, name, arg))
            assert d.max() <= 1 and (d > 0).mean() <= 0.05, (level, sign, d.max(), (d > 0).mean())


# ------------------------------------------------------------------- big_vision's ops vs TF ops

def _tf_transform(tf, a: np.ndarray, t: list[float]) -> np.ndarray:
    """tfa.image.transform as big_vision calls it: nearest, constant fill; ``wrap``/``unwrap`` then
    put 128 where the fill landed (exactly so with nearest sampling)."""
    h, w, _ = a.shape
    return tf.raw_ops.ImageProjectiveTransformV3(
        images=tf.constant(a[None], tf.float32),
        transforms=tf.constant([t + [0.0, 0.0]], tf.float32),
        output_shape=tf.constant([h, w], tf.int32), fill_value=tf.constant(128.0),
        interpolation="NEAREST", fill_mode="CONSTANT").numpy()[0]


def test_bigvision_geometric_ops_match_tf():
    """Transforms written from tfa (angles_to_projective_transforms, translations_to_projective_
    transforms) and big_vision's shear; TF samples. Nearest neighbour: exact except where a float32
    source coordinate sits on a .5 tie (allowed on <= 0.5% of pixels)."""
    tf = pytest.importorskip("tensorflow")
    for a in _images(4, 2):
        h, w, _ = a.shape
        for name in ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY"):
            for level, sign in ((10.0, 1.0), (4.0, -1.0)):
                arg = float(ra.level_to_arg("bigvision", name, jnp.float32(level),
                                            jnp.float32(sign)))
                if name == "Rotate":
                    r = math.radians(arg)
                    c, s = math.cos(r), math.sin(r)
                    t = [c, -s, ((w - 1) - (c * (w - 1) - s * (h - 1))) / 2,
                         s, c, ((h - 1) - (s * (w - 1) + c * (h - 1))) / 2]
                else:
                    t = {"ShearX": [1, arg, 0, 0, 1, 0], "ShearY": [1, 0, 0, arg, 1, 0],
                         "TranslateX": [1, 0, arg, 0, 1, 0],
                         "TranslateY": [1, 0, 0, 0, 1, arg]}[name]
                ours = ra.apply_op(BV, name, _f(a), jnp.float32(level), jnp.float32(sign),
                                   jax.random.key(0))
                d = _diff(ours, _tf_transform(tf, a, [float(v) for v in t]))
                assert (d > 0).mean() <= 0.005, (name, level, (d > 0).mean())


def test_bigvision_contrast_sharpness_cutout_posterize_match_tf_formulas():
    """big_vision's TF code, rewritten in numpy/TF here: contrast's grey is sum(hist) / 256 (the
    pixel count over 256), sharpness truncates the VALID 3x3 smoothing, cutout fills 128."""
    tf = pytest.importorskip("tensorflow")
    a = _images(5, 1)[0]
    h, w, _ = a.shape
    x = _f(a)
    f = 1.9  # level 10
    grey = np.full_like(a, int(min(h * w / 256.0, 255.0)), dtype=np.float64)
    blend = lambda d, im: np.floor(np.clip(d + f * (im - d), 0, 255))  # noqa: E731
    np.testing.assert_array_equal(
        ra.apply_op(BV, "Contrast", x, jnp.float32(10), jnp.float32(1), jax.random.key(0)),
        blend(grey, a.astype(np.float64)))
    k = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32).reshape(3, 3, 1, 1) / 13.0
    conv = tf.nn.depthwise_conv2d(tf.constant(a[None], tf.float32), np.tile(k, (1, 1, 3, 1)),
                                  [1, 1, 1, 1], "VALID").numpy()[0]
    smooth = a.astype(np.float64)
    smooth[1:-1, 1:-1] = np.floor(np.clip(conv, 0, 255))
    d = _diff(ra.apply_op(BV, "Sharpness", x, jnp.float32(10), jnp.float32(1), jax.random.key(0)),
              blend(smooth, a.astype(np.float64)))
    assert d.max() <= 1 and (d > 0).mean() <= 0.01
    ref = tf.bitwise.left_shift(tf.bitwise.right_shift(tf.constant(a), 4), 4).numpy()
    np.testing.assert_array_equal(ops.posterize(x, jnp.float32(4)), ref)
    key = jax.random.key(7)
    cy, cx = (int(v) for v in jax.random.randint(key, (2,), 0, jnp.array([h, w])))
    ref = a.copy()
    ref[max(0, cy - 8):cy + 8, max(0, cx - 8):cx + 8] = 128  # level 2: pad int(40 * 2 / 10) = 8
    np.testing.assert_array_equal(ra.apply_op(BV, "Cutout", x, jnp.float32(2), jnp.float32(1), key),
                                  ref)


# ------------------------------------------------------------------------ magnitude mapping

def _timm_arg(name: str, level: float, sign: float):
    """timm auto_augment's LEVEL_TO_ARG with _randomly_negate replaced by an explicit sign."""
    neg = lambda v: sign * v  # noqa: E731
    table = {
        "Rotate": lambda m: neg((m / 10.0) * 30.0),
        "Posterize": lambda m: int((m / 10.0) * 4),
        "PosterizeIncreasing": lambda m: 4 - int((m / 10.0) * 4),
        "Solarize": lambda m: min(256, int((m / 10.0) * 256)),
        "SolarizeIncreasing": lambda m: 256 - min(256, int((m / 10.0) * 256)),
        "SolarizeAdd": lambda m: min(128, int((m / 10.0) * 110)),
        "ShearX": lambda m: neg((m / 10.0) * 0.3), "ShearY": lambda m: neg((m / 10.0) * 0.3),
        "TranslateXRel": lambda m: neg((m / 10.0) * 0.45),
        "TranslateYRel": lambda m: neg((m / 10.0) * 0.45),
    }
    if name in table:
        return table[name](level)
    if name.endswith("Increasing"):
        return max(0.1, 1.0 + neg((level / 10.0) * 0.9))
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return (level / 10.0) * 1.8 + 0.1
    return 0.0


def _bigvision_arg(name: str, level: float, sign: float):
    """big_vision autoaugment.level_to_arg with HParams(cutout_const=40, translate_const=100)."""
    table = {
        "Rotate": lambda m: sign * (m / 10.0) * 30.0, "Posterize": lambda m: int((m / 10.0) * 4),
        "Solarize": lambda m: int((m / 10.0) * 256), "SolarizeAdd": lambda m: int((m / 10.0) * 110),
        "ShearX": lambda m: sign * (m / 10.0) * 0.3, "ShearY": lambda m: sign * (m / 10.0) * 0.3,
        "TranslateX": lambda m: sign * (m / 10.0) * 100.0,
        "TranslateY": lambda m: sign * (m / 10.0) * 100.0,
        "Cutout": lambda m: int((m / 10.0) * 40),
    }
    if name in table:
        return table[name](level)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return (level / 10.0) * 1.8 + 0.1
    return 0.0


def test_level_to_arg_matches_the_published_formulas():
    rng = np.random.default_rng(6)
    levels = [float(v) for v in range(11)] + [float(np.float32(v)) for v in rng.uniform(0, 10, 40)]
    timm_names = set(ra.TIMM_INCREASING + ra.TIMM_PLAIN)
    for style, names, ref, extra in (("timm", timm_names, _timm_arg, []),
                                     ("bigvision", set(ra.BIGVISION), _bigvision_arg,
                                      [15.0, 20.0])):
        for name in sorted(names):
            for level in levels + extra:
                for sign in (1.0, -1.0):
                    got = float(ra.level_to_arg(style, name, jnp.float32(level), jnp.float32(sign)))
                    want = ref(name, level, sign)
                    if isinstance(want, int):
                        assert got == want, (style, name, level, got, want)
                    else:
                        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (style, name, level)


def test_parse_variants_and_errors():
    assert ra.parse("") is None
    assert TIMM.ops == ra.TIMM_INCREASING and len(TIMM.ops) == 15
    assert (TIMM.magnitude, TIMM.mstd, TIMM.num_layers, TIMM.prob, TIMM.mmax) == (
        9, 0.5, 2, 0.5, 10)
    c = ra.parse("rand-m7-n3-p0.8-mstd101-mmax12")
    assert (c.ops, c.magnitude, c.num_layers, c.prob, c.mstd, c.mmax) == (
        ra.TIMM_PLAIN, 7, 3, 0.8, math.inf, 12)
    assert BV.ops == ra.BIGVISION and len(BV.ops) == 16
    assert (BV.num_layers, BV.magnitude, BV.prob, BV.mmax, BV.mstd) == (2, 10, 1.0, None, 0.0)
    for bad in ("autoaug", "rand-x3", "rand-tweights", "rand-p1.5", "rand-n0", "bigvision-2",
                "bigvision-2-a", "bigvision-2-30"):
        with pytest.raises(ValueError, match="config.randaugment"):
            ra.parse(bad)
    with pytest.raises(ValueError, match="config.randaugment"):
        c = tiny_demo_config(randaugment="rand-m9-bogus1")
        batch_aug.validate(c, data.resolve_data_spec(c))


# ------------------------------------------------------------------------------- sampling

def test_magnitude_noise_is_clipped_gaussian():
    """timm: random.gauss(9, 0.5) clipped to [0, 10]: P(level = 10) = 1 - Phi(2) = 0.0228."""
    lv = np.asarray(jax.vmap(lambda k: ra.sample_level(k, TIMM))(jax.random.split(jax.random.key(0),
                                                                                   40000)))
    assert lv.min() >= 0 and lv.max() == 10.0
    np.testing.assert_allclose((lv == 10).mean(), 0.5 * math.erfc(2 / math.sqrt(2)), atol=0.003)
    inside = lv[lv < 10]
    np.testing.assert_allclose(np.median(inside), 9.0, atol=0.02)
    u = np.asarray(jax.vmap(lambda k: ra.sample_level(k, ra.parse("rand-m8-mstd101")))(
        jax.random.split(jax.random.key(1), 20000)))
    np.testing.assert_allclose([u.mean(), u.max() <= 8], [4.0, True], atol=0.06)


def test_op_probability_per_layer():
    """Two layers each applied with p = 0.5: a row is left alone with probability 0.25."""
    cfg = dataclasses.replace(TIMM, fill=FILL)
    x = jnp.zeros((4000, 4, 4, 3))
    _, ran = jax.jit(jax.vmap(lambda k, im: ra.augment_image(k, im, cfg)))(
        jax.random.split(jax.random.key(2), 4000), x)
    np.testing.assert_allclose(1 - np.asarray(ran).mean(), 0.25, atol=0.02)


def test_normalization_round_trip_and_untouched_rows():
    """Invert alone, always applied, on zscore-normalized integer pixels = normalized (255 - p)."""
    c = tiny_demo_config(randaugment="rand-m9-n1-p1")
    c.data.name, c.data.normalize = "cifar10", "zscore"
    cfg = dataclasses.replace(ra.from_config(c, data.resolve_data_spec(c)), ops=("Invert",))
    assert cfg.fill == (125.0, 123.0, 114.0)  # round(255 * CIFAR-10 mean)
    scale, shift = np.array(cfg.scale), np.array(cfg.shift)
    p = np.random.default_rng(8).integers(0, 256, (3, 8, 8, 3)).astype(np.float64)
    x = (p / 255 * scale + shift).astype(np.float32)
    got = ra.augment(jax.random.key(0), jnp.asarray(x), cfg)
    np.testing.assert_allclose(got, (255 - p) / 255 * scale + shift, atol=1e-5)
    off = dataclasses.replace(cfg, prob=0.0)
    np.testing.assert_array_equal(ra.augment(jax.random.key(0), jnp.asarray(x), off), x)


@pytest.mark.parametrize("preset, fill", [
    ("vit_ln.py:deit_t", (124.0, 116.0, 104.0)),  # timm IMAGENET_DEFAULT_MEAN
    ("vit_learnable_scaler.py:paper", (128.0, 128.0, 128.0))])  # IMAGENET_INCEPTION_MEAN 0.5
def test_timm_fill_is_the_mean_of_the_normalization_the_preset_trains_with(preset, fill):
    """timm's create_transform sets img_mean = round(255 * x) of its Normalize mean: LS trains
    with mean 0.5 (data.normalize='minus_one_one'), so it fills with 128, not ImageNet's mean."""
    import importlib
    module, variant = preset.split(":")
    c = importlib.import_module(f"configs.{module[:-3]}").get_config(variant)
    cfg = ra.from_config(c, data.resolve_data_spec(c))
    assert cfg.style == "timm" and cfg.fill == fill


@pytest.mark.parametrize("normalize", data.NORMALIZE)
def test_normalization_mean_is_the_pixel_mapped_to_zero(normalize):
    """Whatever the mode, the fill's pixel is the one the model input sees as 0 (float64 check
    of the affine's own arithmetic on random statistics)."""
    rng = np.random.default_rng(3)
    s = {"mean": rng.uniform(0.3, 0.6, 3), "std": rng.uniform(0.1, 0.3, 3),
         "min": rng.uniform(0.0, 0.1, 3), "max": rng.uniform(0.9, 1.0, 3)}
    m = data_stats.normalization_mean(s, normalize)
    scale, shift = data_stats.affine_of(s, normalize)
    np.testing.assert_allclose(m * np.float64(scale) + np.float64(shift), 0.0, atol=1e-6)


def test_deterministic_in_the_key_and_differs_across_steps_and_rows():
    cfg = dataclasses.replace(TIMM, fill=FILL)
    x = jax.random.uniform(jax.random.key(0), (8, 16, 16, 3), minval=-1, maxval=1)
    f = jax.jit(lambda k, im: ra.augment(k, im, cfg))
    step_key = lambda s: jax.random.fold_in(jax.random.key(5), s)  # noqa: E731
    a, b, c = f(step_key(3), x), f(step_key(3), x), f(step_key(4), x)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    same = jnp.tile(x[:1], (8, 1, 1, 1))
    out = np.asarray(f(step_key(3), same))
    assert len({out[i].tobytes() for i in range(8)}) > 4  # per-row keys


# ----------------------------------------------------------------------- wiring, train and eval

def test_default_config_has_no_batch_transform_and_eval_never_augments():
    assert tiny_demo_config().randaugment == ""
    assert batch_aug.make(tiny_demo_config(), data.resolve_data_spec(tiny_demo_config())) is None
    assert batch_aug.make(tiny_demo_config(randaugment="bigvision-2-10"),
                          data.resolve_data_spec(tiny_demo_config())) is not None
    # the eval step takes no batch transform: RandAugment is a train-step-only op
    assert "batch_transform" not in inspect.signature(steps_lib.make_eval_step).parameters


def test_batch_aug_runs_randaugment_before_erasing_on_its_own_stream():
    c = tiny_demo_config(randaugment="rand-m9-mstd0.5-inc1", random_erase_prob=0.5)
    transform = batch_aug.make(c, data.resolve_data_spec(c))
    x = jax.random.uniform(jax.random.key(1), (6, 8, 8, 3))  # digits demo: zero_one
    y = jnp.arange(6)
    key = jax.random.key(9)
    got, labels = jax.jit(transform)(key, x, y)
    k_erase, _ = jax.random.split(jax.random.fold_in(key, batch_aug.STREAM))
    ra_cfg, erase_cfg = ra.from_config(c, data.resolve_data_spec(c)), erasing.from_config(c)
    ref = jax.jit(lambda im: erasing.erase(k_erase, ra.augment(
        jax.random.fold_in(key, batch_aug.RA_STREAM), im, ra_cfg), erase_cfg))(x)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(labels, y)
    assert not np.array_equal(got, x)


@pytest.mark.parametrize("spec", ["rand-m9-mstd0.5-inc1", "bigvision-2-10"])
def test_layer_switch_matches_each_op(spec):
    """The per-layer switch (geometric ops sharing one resampler) equals ``apply_op`` per op."""
    cfg = dataclasses.replace(ra.parse(spec), fill=FILL)
    x = _f(_images(9, 1, (12, 10))[0])
    key, level, sign = jax.random.key(3), jnp.float32(7.3), jnp.float32(-1.0)
    idx = jnp.arange(len(cfg.ops))
    got = jax.jit(jax.vmap(lambda i: ra._one_layer(cfg, i, x, level, sign, key)))(idx)
    for i, name in enumerate(cfg.ops):
        np.testing.assert_array_equal(got[i], ra.apply_op(cfg, name, x, level, sign, key), name)

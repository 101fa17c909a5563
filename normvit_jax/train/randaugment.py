"""RandAugment on device, per image, inside the jitted train step: timm's and big_vision's variants.

``config.randaugment`` picks the variant (``''``: off):
  * ``'rand-m9-mstd0.5-inc1'`` (timm's string; DeiT's recipe). Sections: ``m`` magnitude (default
    10), ``n`` layers (2), ``p`` probability of each layer (0.5), ``mstd`` std of Gaussian noise on
    the magnitude per op call (0; > 100 means uniform in [0, m]), ``mmax`` upper clip of the
    magnitude (10), ``inc`` 1: the 'Increasing' op set. timm's transform-set ('t...') sections are
    not supported. (timm reads ``inc0`` as on, since ``bool('0')`` is True; here ``inc0`` is off.)
  * ``'bigvision-2-10'``: big_vision's ``randaug(num_layers=2, magnitude=10)``
    (big_vision/pp/archive/autoaugment.py, the TF EfficientNet code): every layer applies its op
    (no skip probability), fixed magnitude (no noise, no clip), constants in absolute pixels.

Per image and layer: one op uniformly from the set (with replacement across layers), a magnitude
``level`` (timm: ``clip(m + mstd * N(0, 1), 0, mmax)``; big_vision: ``m``), a random sign for signed
ops, and (timm) the op is skipped with probability ``1 - p``. ``level / 10`` sets the strength:

  op (timm inc1 | big_vision)  argument from level L (s = random sign)           fill
  AutoContrast                 none                                               -
  Equalize                     none                                               -
  Invert                       none                                               -
  Rotate                       s * 30 L/10 degrees (both)                         F
  PosterizeIncreasing          bits kept = 4 - int(4 L/10)                        -
    | Posterize                bits kept = int(4 L/10)                            -
  SolarizeIncreasing           threshold = 256 - min(256, int(256 L/10))          -
    | Solarize                 threshold = int(256 L/10) (256 at L=10: no change) -
  SolarizeAdd                  add = min(128, int(110 L/10)) | int(110 L/10),
                               to pixels < 128, clipped at 255                    -
  ColorIncreasing, Contrast-,  factor = max(0.1, 1 + s * 0.9 L/10)                -
  Brightness-, Sharpness-      | factor = 0.1 + 1.8 L/10 (no sign)
  ShearX, ShearY               s * 0.3 L/10 (x_in = x + f y, resp. y_in = y + f x)  F
  TranslateXRel, -YRel         s * 0.45 L/10 of the width/height                  F
    | TranslateX, TranslateY   s * 100 L/10 pixels                                F
    | Cutout                   square of side 2 int(40 L/10), centre uniform      128

The non-increasing timm set (inc0) uses the big_vision column's Posterize/Solarize/enhance
mappings with timm's SolarizeAdd cap and TranslateRel. Fill F: timm fills with ``round(255 * mean)``
of its Normalize's mean (its ``img_mean`` hparam from ``create_transform``): here the pixel that
``data.normalize`` maps to 0 (``stats.normalization_mean``: the training mean for zscore, 128 for
minus_one_one, as timm's 0.5 mean); big_vision with 128.
Geometric resampling: timm runs PIL with a random bilinear/bicubic choice (DeiT: bicubic); we use
bilinear, PIL's pixel-centre convention. big_vision runs tfa's nearest-neighbour transform, which
we reproduce (pixel-index convention, rotation about ((W-1)/2, (H-1)/2)). Contrast under big_vision
blends toward the grey level #pixels/256, the TF code's known quirk, reproduced (``randaug_ops``).

Images arrive normalized (``data/stats.affine``: ``x = x01 * scale + shift``); they are mapped back
to [0, 255], rounded (PIL works on uint8), augmented, and normalized again. Rows where no op ran
are returned bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp

from normvit_jax.data import stats
from normvit_jax.data.dataspec import DataSpec
from normvit_jax.train import randaug_ops as ops

TIMM_INCREASING = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing",
                   "SolarizeIncreasing", "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing",
                   "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY",
                   "TranslateXRel", "TranslateYRel")
TIMM_PLAIN = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize",
              "SolarizeAdd", "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY",
              "TranslateXRel", "TranslateYRel")
BIGVISION = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "Color",
             "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateX", "TranslateY",
             "Cutout", "SolarizeAdd")
GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel", "TranslateX",
             "TranslateY")
_ENHANCE = {"Color": ops.color, "Contrast": ops.contrast, "Brightness": ops.brightness,
            "Sharpness": ops.sharpness}


@dataclasses.dataclass(frozen=True)
class RandAugConfig:
    style: str                      # 'timm' | 'bigvision'
    ops: tuple[str, ...]
    num_layers: int = 2
    magnitude: float = 10.0
    mstd: float = 0.0               # inf: uniform in [0, magnitude]
    mmax: float | None = 10.0       # None: no clip (big_vision)
    prob: float = 0.5
    fill: tuple[float, ...] = (128.0, 128.0, 128.0)
    scale: tuple[float, ...] = (2.0, 2.0, 2.0)   # model input = pixel / 255 * scale + shift
    shift: tuple[float, ...] = (-1.0, -1.0, -1.0)


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"config.randaugment={spec!r}: {why}. Accepted: '' (off), timm's "
                      "'rand-m9-mstd0.5-inc1' (sections m, n, p, mstd, mmax, inc), or "
                      "'bigvision-<num_layers>-<magnitude>' such as 'bigvision-2-10'")


def parse(spec: str) -> RandAugConfig | None:
    """The config string -> a RandAugConfig with default normalization/fill, or None if ''."""
    spec = (spec or "").strip()
    if not spec:
        return None
    parts = spec.split("-")
    if parts[0] == "bigvision":
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise _bad(spec, "expected 'bigvision-<int>-<int>'")
        n, m = int(parts[1]), int(parts[2])
        if n < 1 or m > 20:
            raise _bad(spec, "num_layers must be >= 1 and magnitude <= 20 (Posterize's bits)")
        return RandAugConfig("bigvision", BIGVISION, n, float(m), 0.0, None, 1.0)
    if parts[0] != "rand":
        raise _bad(spec, f"unknown variant {parts[0]!r}")
    kw: dict[str, float] = {"m": 10, "n": 2, "p": 0.5, "mstd": 0.0, "mmax": 10, "inc": 0}
    for part in parts[1:]:
        match = re.fullmatch(r"(mstd|mmax|inc|m|n|p)(\d+(?:\.\d*)?)", part)
        if match is None:
            raise _bad(spec, f"unknown or malformed section {part!r}")
        kw[match[1]] = float(match[2])
    if kw["n"] < 1 or not 0 <= kw["p"] <= 1 or kw["mmax"] <= 0:
        raise _bad(spec, "needs n >= 1, 0 <= p <= 1, mmax > 0")
    mstd = math.inf if kw["mstd"] > 100 else kw["mstd"]
    return RandAugConfig("timm", TIMM_INCREASING if kw["inc"] else TIMM_PLAIN, int(kw["n"]),
                         kw["m"], mstd, kw["mmax"], kw["p"])


def from_config(config: Any, data_spec: DataSpec) -> RandAugConfig | None:
    """Parses ``config.randaugment`` and adds the data's normalization and timm's mean fill
    (from ``data_spec``, the run's ``data.DataSpec``)."""
    cfg = parse(config.randaugment)
    if cfg is None:
        return None
    scale, shift = data_spec.affine
    fill = cfg.fill
    if cfg.style == "timm":  # timm's img_mean: round(255 * mean) of the Normalize it trains with
        mean = stats.normalization_mean(data_spec.stats(), data_spec.normalize)
        fill = tuple(float(min(255, round(255 * float(v)))) for v in mean)
    return dataclasses.replace(cfg, scale=tuple(map(float, scale)), shift=tuple(map(float, shift)),
                               fill=fill)


def level_to_arg(style: str, name: str, level: jax.Array, sign: jax.Array) -> jax.Array:
    """The op's argument from the magnitude ``level`` and a sign in {-1, 1} (see the table)."""
    frac = level / 10.0
    # Python's int() of (level / 10) * c on non-negative levels; level * c / 10 is exact in float32
    # for integer levels, where the float64 reference lands on integers (e.g. 7 / 10 * 110)
    trunc = lambda c: jnp.floor(level * c / 10.0)  # noqa: E731
    if name == "Rotate":
        return sign * frac * 30.0
    if name in ("ShearX", "ShearY"):
        return sign * frac * 0.3
    if name in ("TranslateXRel", "TranslateYRel"):
        return sign * frac * 0.45
    if name in ("TranslateX", "TranslateY"):
        return sign * frac * 100.0
    if name == "Cutout":
        return trunc(40.0)
    if name == "Posterize":
        return trunc(4.0)
    if name == "PosterizeIncreasing":
        return 4.0 - trunc(4.0)
    if name == "Solarize":
        return trunc(256.0) if style == "bigvision" else jnp.minimum(256.0, trunc(256.0))
    if name == "SolarizeIncreasing":
        return 256.0 - jnp.minimum(256.0, trunc(256.0))
    if name == "SolarizeAdd":
        add = trunc(110.0)
        return add if style == "bigvision" else jnp.minimum(128.0, add)
    if name.endswith("Increasing"):
        return jnp.maximum(0.1, 1.0 + sign * frac * 0.9)
    if name in _ENHANCE:
        return frac * 1.8 + 0.1
    return jnp.zeros(())  # AutoContrast, Equalize, Invert


def affine_matrix(style: str, name: str, arg: jax.Array, h: int, w: int) -> jax.Array:
    """2x3 map from output to input coordinates (PIL's pixel centres for timm, TF's pixel indices
    for big_vision), as the reference libraries build it."""
    one, zero = jnp.ones(()), jnp.zeros(())
    row = lambda *v: jnp.stack([jnp.asarray(x, jnp.float32) for x in v])  # noqa: E731
    if name == "ShearX":
        return jnp.stack([row(one, arg, zero), row(zero, one, zero)])
    if name == "ShearY":
        return jnp.stack([row(one, zero, zero), row(arg, one, zero)])
    if name in ("TranslateXRel", "TranslateX"):
        dx = arg * w if name.endswith("Rel") else arg
        return jnp.stack([row(one, zero, dx), row(zero, one, zero)])
    if name in ("TranslateYRel", "TranslateY"):
        dy = arg * h if name.endswith("Rel") else arg
        return jnp.stack([row(one, zero, zero), row(zero, one, dy)])
    assert name == "Rotate", name
    if style == "timm":  # PIL Image.rotate: counter-clockwise about (w/2, h/2)
        a = -jnp.deg2rad(arg)
        c, s = jnp.cos(a), jnp.sin(a)
        cx, cy = w / 2.0, h / 2.0
        return jnp.stack([row(c, s, cx - c * cx - s * cy), row(-s, c, cy + s * cx - c * cy)])
    a = jnp.deg2rad(arg)  # tfa.image.rotate: about ((w-1)/2, (h-1)/2)
    c, s = jnp.cos(a), jnp.sin(a)
    x_off = ((w - 1) - (c * (w - 1) - s * (h - 1))) / 2.0
    y_off = ((h - 1) - (s * (w - 1) + c * (h - 1))) / 2.0
    return jnp.stack([row(c, -s, x_off), row(s, c, y_off)])


def apply_op(cfg: RandAugConfig, name: str, img: jax.Array, level: jax.Array, sign: jax.Array,
             key: jax.Array) -> jax.Array:
    """One op on one image (H, W, 3) of integers in [0, 255] (``key``: Cutout's centre)."""
    h, w, _ = img.shape
    arg = level_to_arg(cfg.style, name, level, sign)
    fill = jnp.asarray(cfg.fill, jnp.float32)
    tf = cfg.style == "bigvision"
    base = name.removesuffix("Increasing")
    if name in GEOMETRIC:
        return ops.affine(img, affine_matrix(cfg.style, name, arg, h, w), fill, pil_bilinear=not tf)
    if name == "Cutout":
        cy, cx = jax.random.randint(key, (2,), 0, jnp.array([h, w]))
        return ops.cutout(img, cy, cx, arg, jnp.float32(128.0))
    if base == "Contrast":
        return ops.contrast(img, arg, tf_mean_quirk=tf)
    if base == "Sharpness":
        return ops.sharpness(img, arg, tf_truncate=tf)
    if base in _ENHANCE:
        return _ENHANCE[base](img, arg)
    simple: dict[str, Callable[..., jax.Array]] = {
        "AutoContrast": lambda x, _: ops.autocontrast(x), "Equalize": lambda x, _: ops.equalize(x),
        "Invert": lambda x, _: ops.invert(x), "Posterize": ops.posterize,
        "Solarize": ops.solarize, "SolarizeAdd": ops.solarize_add}
    return simple[base](img, arg)


def sample_level(key: jax.Array, cfg: RandAugConfig) -> jax.Array:
    """timm's ``AugmentOp`` magnitude: Gaussian noise (or uniform if mstd is inf), clipped."""
    m = jnp.float32(cfg.magnitude)
    if cfg.mstd == math.inf:
        m = jax.random.uniform(key, (), minval=0.0, maxval=cfg.magnitude)
    elif cfg.mstd > 0:
        m = m + cfg.mstd * jax.random.normal(key, ())
    if cfg.mmax is not None:
        m = jnp.clip(m, 0.0, cfg.mmax)
    return m


def _one_layer(cfg: RandAugConfig, idx: jax.Array, img: jax.Array, level: jax.Array,
               sign: jax.Array, key: jax.Array) -> jax.Array:
    """``apply_op`` of op number ``idx``. Under vmap a switch computes every branch, so the
    geometric ops share one resampling: their branches only build the matrix."""
    h, w, _ = img.shape
    geo = [name in GEOMETRIC for name in cfg.ops]
    pixel = [(lambda x, *_: x) if g else functools.partial(apply_op, cfg, name)
             for name, g in zip(cfg.ops, geo)]
    eye = jnp.eye(2, 3, dtype=jnp.float32)
    matrix = [(lambda lv, sg, name=name: affine_matrix(
        cfg.style, name, level_to_arg(cfg.style, name, lv, sg), h, w)) if g
        else (lambda lv, sg: eye) for name, g in zip(cfg.ops, geo)]
    out = jax.lax.switch(idx, pixel, img, level, sign, key)
    if not any(geo):
        return out
    m = jax.lax.switch(idx, matrix, level, sign)
    warped = ops.affine(img, m, jnp.asarray(cfg.fill, jnp.float32),
                        pil_bilinear=cfg.style == "timm")
    return jnp.where(jnp.asarray(geo)[idx], warped, out)


def augment_image(key: jax.Array, img: jax.Array, cfg: RandAugConfig
                  ) -> tuple[jax.Array, jax.Array]:
    """``num_layers`` random ops on one [0, 255] image; returns (image, whether any op ran)."""
    ran = jnp.zeros((), bool)
    for layer in range(cfg.num_layers):
        keys = jax.random.split(jax.random.fold_in(key, layer), 5)
        k_op, k_apply, k_level, k_sign, k_op_key = keys
        idx = jax.random.randint(k_op, (), 0, len(cfg.ops))
        sign = jnp.where(jax.random.uniform(k_sign) > 0.5, -1.0, 1.0)  # timm's _randomly_negate
        out = _one_layer(cfg, idx, img, sample_level(k_level, cfg), sign, k_op_key)
        do = jax.random.uniform(k_apply) < cfg.prob if cfg.prob < 1 else jnp.ones((), bool)
        img = jnp.where(do, out, img)
        ran = ran | do
    return img, ran


def augment(key: jax.Array, images: jax.Array, cfg: RandAugConfig) -> jax.Array:
    """RandAugment of a normalized batch (B, H, W, 3), one key per row from ``key``."""
    if images.shape[-1] != 3:
        raise ValueError(f"RandAugment needs RGB images, got shape {images.shape}")
    scale, shift = jnp.asarray(cfg.scale), jnp.asarray(cfg.shift)
    x = images.astype(jnp.float32)
    pixels = jnp.clip(jnp.round((x - shift) / scale * 255.0), 0.0, 255.0)
    keys = jax.random.split(key, images.shape[0])
    out, ran = jax.vmap(lambda k, im: augment_image(k, im, cfg))(keys, pixels)
    out = (out / 255.0 * scale + shift).astype(images.dtype)
    return jnp.where(ran[:, None, None, None], out, images)

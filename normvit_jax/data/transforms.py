"""Host-side image geometry in numpy for in-memory arrays, driven by given uniform draws (the same
crop rules for JPEGs are TF ops in ``tf_images``).

Randomness never comes from a generator in here: each example gets a row of ``NUM_UNIFORMS``
uniforms in [0, 1) (see ``order.aug_uniforms``), so the same row always yields the same image.
Two stages, shared by every source:
  1. to ``size x size``: random resized crop (train, when enabled: timm's ``RandomResizedCrop``
     rule, its fallback included), else a central square crop of
     ``fraction`` of the shorter side, then a bilinear or bicubic resize (``data.interpolation``,
     'random': one of the two per example; antialiased when shrinking, unless ``data.antialias``
     is False);
  2. train only, at ``size``: zero-pad by ``padding`` pixels and take a random crop; random flip.
"""
from __future__ import annotations

import functools
import math

import numpy as np

RRC_ATTEMPTS = 10
RRC_RATIO = (3 / 4, 4 / 3)  # the aspect-ratio (width / height) limits of the random resized crop
U_FLIP, U_PAD_Y, U_PAD_X, U_POS_Y, U_POS_X, U_RRC = 0, 1, 2, 3, 4, 5
U_INTERP = U_RRC + 2 * RRC_ATTEMPTS  # RRC: per attempt an area fraction and a log aspect ratio
NUM_UNIFORMS = U_INTERP + 1
Box = tuple[int, int, int, int]  # (left, top, right, bottom), PIL's order


INTERPOLATIONS = ("bilinear", "bicubic", "random")
_KEYS_A = -0.5  # the cubic convolution kernel's a, as PIL's and TF's bicubic


def pick_interpolation(interpolation: str, u: np.ndarray | None) -> str:
    """'random' (timm's train transform): bilinear or bicubic with equal odds from the example's
    ``U_INTERP`` uniform; without draws (evaluation) bicubic, the filter timm evaluates with."""
    if interpolation != "random":
        return interpolation
    return "bicubic" if u is None or u[U_INTERP] >= 0.5 else "bilinear"


def _kernel(d: np.ndarray, interpolation: str) -> np.ndarray:
    d = np.abs(d)
    if interpolation == "bilinear":
        return np.maximum(0.0, 1.0 - d)
    a = _KEYS_A  # Keys (1981) cubic convolution, support 2
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d < 1, near, np.where(d < 2, far, 0.0))


@functools.lru_cache(maxsize=256)
def _weights(n_in: int, n_out: int, antialias: bool = True,
             interpolation: str = "bilinear") -> np.ndarray:
    """(n_out, n_in) rows summing to 1 (half-pixel centres, taps outside the image dropped): the
    triangle (bilinear) or Keys cubic (bicubic) filter, stretched by the scale when shrinking if
    ``antialias`` (PIL's resize), else plain interpolation (TF's)."""
    scale = n_in / n_out
    support = max(scale, 1.0) if antialias else 1.0
    centers = (np.arange(n_out) + 0.5) * scale
    d = (np.arange(n_in)[None, :] + 0.5 - centers[:, None]) / support
    w = _kernel(d, interpolation)
    w /= w.sum(1, keepdims=True)
    w = w.astype(np.float32)
    w.setflags(write=False)
    return w


def resize(x: np.ndarray, size: int, antialias: bool = True,
           interpolation: str = "bilinear") -> np.ndarray:
    """Bilinear or bicubic resize of float images (..., H, W, C) to (..., size, size, C); bicubic
    can overshoot the input's range (callers clip)."""
    h, w = x.shape[-3], x.shape[-2]
    if (h, w) == (size, size):
        return x
    return np.einsum("yh,...hwc,xw->...yxc", _weights(h, size, antialias, interpolation), x,
                     _weights(w, size, antialias, interpolation), optimize=True).astype(np.float32)


@functools.lru_cache(maxsize=256)
def _area_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in): output pixel o averages the input over [o, o + 1) * n_in / n_out, each input
    pixel weighted by its overlap (TF's 'area' resize)."""
    s = n_in / n_out
    lo, hi = np.arange(n_out)[:, None] * s, (np.arange(n_out)[:, None] + 1) * s
    i = np.arange(n_in)[None, :]
    w = (np.clip(np.minimum(i + 1, hi) - np.maximum(i, lo), 0.0, None) / s).astype(np.float32)
    w.setflags(write=False)
    return w


def resize_small_crop(x: np.ndarray, small: int, size: int) -> np.ndarray:
    """big_vision's eval ``resize_small(small)|central_crop(size)`` of float images (N, H, W, C):
    the shorter side to ``small`` ('area', the sides rounded as its ``_resize_factor``), then the
    central ``size x size`` crop (offsets floored)."""
    h, w = x.shape[1:3]
    factor = np.float32(small) / np.float32(min(h, w))
    nh, nw = int(np.round(np.float32(h) * factor)), int(np.round(np.float32(w) * factor))
    y = np.einsum("yh,nhwc,xw->nyxc", _area_weights(h, nh), x, _area_weights(w, nw),
                  optimize=True).astype(np.float32)
    top, left = (nh - size) // 2, (nw - size) // 2
    return y[:, top:top + size, left:left + size]


def central_box(h: int, w: int, fraction: float) -> Box:
    side = max(1, int(round(fraction * min(h, w))))
    top, left = (h - side) // 2, (w - side) // 2
    return left, top, left + side, top + side


def rrc_fallback_box(h: int, w: int) -> Box:
    """timm's/torchvision's ``RandomResizedCrop`` when no draw fits: the whole image, narrowed to
    the aspect-ratio limits [3/4, 4/3] if it is outside them, centred (offsets floored)."""
    in_ratio = w / h
    cw, ch = w, h
    if in_ratio < RRC_RATIO[0]:
        ch = int(round(w / RRC_RATIO[0]))
    elif in_ratio > RRC_RATIO[1]:
        cw = int(round(h * RRC_RATIO[1]))
    top, left = (h - ch) // 2, (w - cw) // 2
    return left, top, left + cw, top + ch


def random_resized_box(h: int, w: int, u: np.ndarray, min_area: float) -> Box:
    """Inception-style crop (timm's ``RandomResizedCrop``): area fraction in [min_area, 1], aspect
    ratio in [3/4, 4/3] (log-uniform), first of ``RRC_ATTEMPTS`` draws that fits; otherwise
    ``rrc_fallback_box``."""
    lo, hi = math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])
    for k in range(RRC_ATTEMPTS):
        area = h * w * (min_area + (1.0 - min_area) * u[U_RRC + 2 * k])
        ratio = math.exp(lo + (hi - lo) * u[U_RRC + 2 * k + 1])
        cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            top = min(int(u[U_POS_Y] * (h - ch + 1)), h - ch)
            left = min(int(u[U_POS_X] * (w - cw + 1)), w - cw)
            return left, top, left + cw, top + ch
    return rrc_fallback_box(h, w)


def array_to_size(x: np.ndarray, size: int, u: np.ndarray | None, *, rrc: bool,
                  min_area: float, fraction: float, antialias: bool = True,
                  interpolation: str = "bilinear", resize_small: int = 0) -> np.ndarray:
    """Stage 1 for a batch of equal-size float images (N, H, W, C); ``u`` (N, NUM_UNIFORMS).
    ``resize_small`` > 0 (evaluation): ``resize_small_crop`` instead of crop-then-resize."""
    n, h, w = x.shape[:3]
    if resize_small and not rrc:
        return resize_small_crop(x, resize_small, size)
    if rrc or interpolation == "random":  # a box or a filter per image
        out = np.empty((n, size, size, x.shape[-1]), np.float32)
        for i in range(n):
            ui = None if u is None else u[i]
            left, top, right, bottom = (random_resized_box(h, w, ui, min_area) if rrc
                                        else central_box(h, w, fraction))
            out[i] = resize(x[i, top:bottom, left:right], size, antialias,
                            pick_interpolation(interpolation, ui))
        return out
    left, top, right, bottom = central_box(h, w, fraction)
    return resize(x[:, top:bottom, left:right], size, antialias, interpolation)


def pad_crop_flip(x: np.ndarray, u: np.ndarray, padding: int, flip: bool) -> np.ndarray:
    """Stage 2, vectorized over a batch (N, S, S, C) with uniforms ``u`` (N, NUM_UNIFORMS)."""
    n, s = x.shape[0], x.shape[1]
    if padding > 0:
        p = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
        span = 2 * padding + 1
        oy = np.minimum((u[:, U_PAD_Y] * span).astype(np.int64), span - 1)
        ox = np.minimum((u[:, U_PAD_X] * span).astype(np.int64), span - 1)
        rows = oy[:, None] + np.arange(s)
        cols = ox[:, None] + np.arange(s)
        x = p[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    if flip:
        f = u[:, U_FLIP] < 0.5
        x = np.where(f[:, None, None, None], x[:, :, ::-1], x)
    return x

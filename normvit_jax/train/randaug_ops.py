"""The image ops of RandAugment in JAX, on one float32 image (H, W, 3) holding integers in [0, 255].

Each op returns integers in [0, 255] again, as PIL's uint8 ops do, so ops chain like timm's PIL
pipeline. Arguments may be traced scalars (the magnitude is random per image). The semantics are
PIL's (``ImageOps``, ``ImageEnhance``, ``Image.transform``; what timm calls), and for the few ops
where big_vision's TF code differs the difference is a flag (``tf_*`` arguments):
  * blends truncate toward zero and clip when extrapolating (PIL ``Image.blend`` and TF alike);
  * grey is PIL's integer luma ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``; big_vision's
    ``tf.image.rgb_to_grayscale`` differs from it by at most 1 level (we use PIL's for both);
  * geometric ops map output pixels to input points with a 2x3 matrix (``affine``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def invert(img: Array) -> Array:
    return 255.0 - img


def posterize(img: Array, bits: Array) -> Array:
    """Keeps the ``bits`` (0..8) most significant bits; powers of two keep the float math exact."""
    q = jnp.exp2(8.0 - jnp.clip(bits, 0, 8).astype(jnp.float32))
    return jnp.floor(img / q) * q


def solarize(img: Array, threshold: Array) -> Array:
    return jnp.where(img < threshold, img, 255.0 - img)


def solarize_add(img: Array, add: Array, threshold: float = 128.0) -> Array:
    return jnp.where(img < threshold, jnp.minimum(img + add, 255.0), img)


def _per_channel_lut(img: Array, lut: Array) -> Array:
    """``lut`` (256, C) applied channel-wise."""
    idx = img.astype(jnp.int32)
    return jnp.take_along_axis(lut, idx.reshape(-1, img.shape[-1]), axis=0).reshape(img.shape)


def autocontrast(img: Array) -> Array:
    """Per channel, maps [lo, hi] linearly onto [0, 255] (truncated); constant channels kept."""
    lo = img.min(axis=(0, 1))
    hi = img.max(axis=(0, 1))
    span = jnp.maximum(hi - lo, 1.0)
    out = jnp.clip(jnp.floor((img - lo) * 255.0 / span), 0.0, 255.0)
    return jnp.where(hi > lo, out, img)


def equalize(img: Array) -> Array:
    """PIL ``ImageOps.equalize`` per channel: ``lut[i] = (step // 2 + #pixels below i) // step``
    with ``step = (#pixels - #pixels at the top value) // 255``; identity when ``step`` is 0."""
    idx = img.astype(jnp.int32).reshape(-1, img.shape[-1])
    n = idx.shape[0]

    def channel_lut(col: Array) -> Array:
        hist = jnp.zeros(256, jnp.int32).at[col].add(1)
        step = (n - hist[col.max()]) // 255
        below = jnp.cumsum(hist) - hist
        lut = jnp.clip((step // 2 + below) // jnp.maximum(step, 1), 0, 255)
        return jnp.where(step > 0, lut, jnp.arange(256)).astype(jnp.float32)

    return _per_channel_lut(img, jax.vmap(channel_lut, in_axes=1, out_axes=1)(idx))


def blend(degenerate: Array, img: Array, factor: Array) -> Array:
    """PIL ``Image.blend(degenerate, img, factor)``: truncated, clipped to [0, 255]."""
    return jnp.floor(jnp.clip(degenerate + factor * (img - degenerate), 0.0, 255.0))


def grey(img: Array) -> Array:
    """PIL's RGB -> L (integer luma), shape (H, W, 1)."""
    q = img.astype(jnp.int32)
    y = (q[..., 0] * 19595 + q[..., 1] * 38470 + q[..., 2] * 7471 + 0x8000) >> 16
    return y[..., None].astype(jnp.float32)


def color(img: Array, factor: Array) -> Array:
    return blend(jnp.broadcast_to(grey(img), img.shape), img, factor)


def contrast(img: Array, factor: Array, tf_mean_quirk: bool = False) -> Array:
    """Blend with a uniform grey image: PIL uses the rounded mean luma. The TF EfficientNet code
    that big_vision runs takes ``sum(histogram) / 256`` = #pixels / 256 instead (a known quirk),
    clipped to [0, 255] and truncated; ``tf_mean_quirk`` reproduces it."""
    h, w, _ = img.shape
    if tf_mean_quirk:
        mean = jnp.floor(jnp.minimum(h * w / 256.0, 255.0))
    else:
        mean = jnp.floor(grey(img).mean() + 0.5)
    return blend(jnp.full_like(img, mean), img, factor)


def brightness(img: Array, factor: Array) -> Array:
    return blend(jnp.zeros_like(img), img, factor)


def sharpness(img: Array, factor: Array, tf_truncate: bool = False) -> Array:
    """Blend with PIL's SMOOTH filter (3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13) on interior
    pixels, the 1-pixel border kept. PIL rounds the filtered value; big_vision's TF truncates."""
    p = img
    s = (p[:-2, :-2] + p[:-2, 1:-1] + p[:-2, 2:] + p[1:-1, :-2] + 5 * p[1:-1, 1:-1] + p[1:-1, 2:]
         + p[2:, :-2] + p[2:, 1:-1] + p[2:, 2:]) / 13.0
    s = jnp.floor(jnp.clip(s if tf_truncate else s + 0.5, 0.0, 255.0))
    smooth = img.at[1:-1, 1:-1].set(s)
    return blend(smooth, img, factor)


def cutout(img: Array, cy: Array, cx: Array, pad: Array, fill: Array) -> Array:
    """Rows [cy - pad, cy + pad) and columns [cx - pad, cx + pad), clipped, set to ``fill``."""
    h, w, _ = img.shape
    ys, xs = jnp.arange(h)[:, None, None], jnp.arange(w)[None, :, None]
    inside = (ys >= cy - pad) & (ys < cy + pad) & (xs >= cx - pad) & (xs < cx + pad)
    return jnp.where(inside, fill, img)


def affine(img: Array, m: Array, fill: Array, *, pil_bilinear: bool) -> Array:
    """Resamples ``img`` at ``(x_in, y_in) = m @ (x, y, 1)`` for every output pixel.

    ``pil_bilinear``: PIL's AFFINE transform with BILINEAR: (x, y) are pixel centres (index + 0.5),
    a point outside [0, W) x [0, H) gets ``fill``, inside it the 4 neighbours (indices clamped
    to the image) are interpolated and the result truncated. Else TF's
    ``ImageProjectiveTransformV3`` with NEAREST (what big_vision's tfa ops run): (x, y) are pixel
    indices, the point is rounded half away from zero, outside the image gets ``fill``.
    """
    h, w, _ = img.shape
    ys, xs = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32),
                          indexing="ij")
    off = 0.5 if pil_bilinear else 0.0
    xo, yo = xs + off, ys + off
    xi = m[0, 0] * xo + m[0, 1] * yo + m[0, 2]
    yi = m[1, 0] * xo + m[1, 1] * yo + m[1, 2]
    if pil_bilinear:
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
        xi, yi = xi - 0.5, yi - 0.5
        x0, y0 = jnp.floor(xi), jnp.floor(yi)
        dx, dy = (xi - x0)[..., None], (yi - y0)[..., None]
        x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
        cx = lambda v: jnp.clip(v, 0, w - 1)  # noqa: E731
        cy = lambda v: jnp.clip(v, 0, h - 1)  # noqa: E731
        # clamping both rows is PIL's rule (a missing lower row repeats the upper one)

        def row(yy: Array) -> Array:
            left, right = img[cy(yy), cx(x0)], img[cy(yy), cx(x0 + 1)]
            return left + dx * (right - left)

        top, bot = row(y0), row(y0 + 1)
        out = jnp.floor(jnp.clip(top + dy * (bot - top), 0.0, 255.0))
    else:
        xr = jnp.where(xi >= 0, jnp.floor(xi + 0.5), jnp.ceil(xi - 0.5)).astype(jnp.int32)
        yr = jnp.where(yi >= 0, jnp.floor(yi + 0.5), jnp.ceil(yi - 0.5)).astype(jnp.int32)
        inside = (xr >= 0) & (xr < w) & (yr >= 0) & (yr < h)
        out = img[jnp.clip(yr, 0, h - 1), jnp.clip(xr, 0, w - 1)]
    return jnp.where(inside[..., None], out, fill)

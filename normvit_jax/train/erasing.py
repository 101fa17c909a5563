"""Random erasing on device, with timm's ``RandomErasing`` semantics (one box per image).

With probability ``prob`` an image gets one box: up to ``ATTEMPTS`` draws of an area fraction
uniform in [min_area, max_area] and a log-uniform aspect ratio; sides ``h = round(sqrt(A * r))``,
``w = round(sqrt(A / r))``; the first draw with ``h < H`` and ``w < W`` is used (none: the image is
left as is); its top-left corner is uniform over the integer positions that fit. The box is filled
with per-pixel standard normal noise ('pixel'), one normal value per channel ('rand') or zeros
('const'), in the normalized value range, as timm does after normalization.

As in ``mixing``, ``draw`` makes the random numbers and ``apply`` is pure arithmetic on them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("pixel", "rand", "const")
ATTEMPTS = 10


@dataclasses.dataclass(frozen=True)
class EraseConfig:
    prob: float = 0.0
    mode: str = "pixel"
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3
    max_aspect: float = 1 / 0.3

    @property
    def enabled(self) -> bool:
        return self.prob > 0


def from_config(config: Any) -> EraseConfig:
    prob, mode = float(config.random_erase_prob), config.random_erase_mode
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"config.random_erase_prob={prob} must be in [0, 1]")
    if mode not in MODES:
        raise ValueError(f"config.random_erase_mode={mode!r} is not known; accepted: {list(MODES)}")
    return EraseConfig(prob, mode)


def draw(key: jax.Array, shape: tuple[int, ...], cfg: EraseConfig) -> dict[str, jax.Array]:
    """Uniforms for a batch of ``shape`` (B, H, W, C): 'apply' (B,), 'area' and 'log_ratio'
    (B, ATTEMPTS), 'top'/'left' (B,) in [0, 1), and the fill 'noise' (B, H, W, C)."""
    b = shape[0]
    ks = jax.random.split(key, 6)
    lo, hi = math.log(cfg.min_aspect), math.log(cfg.max_aspect)
    return {
        "apply": jax.random.uniform(ks[0], (b,)),
        "area": jax.random.uniform(ks[1], (b, ATTEMPTS), minval=cfg.min_area, maxval=cfg.max_area),
        "log_ratio": jax.random.uniform(ks[2], (b, ATTEMPTS), minval=lo, maxval=hi),
        "top": jax.random.uniform(ks[3], (b,)),
        "left": jax.random.uniform(ks[4], (b,)),
        "noise": jax.random.normal(ks[5], shape if cfg.mode == "pixel" else (b, 1, 1, shape[-1])),
    }


def boxes(h: int, w: int, params: dict[str, jax.Array], prob: float
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(erase?, top, left, box_h, box_w), each (B,) int32/bool, from the draws."""
    ratio = jnp.exp(params["log_ratio"])
    target = params["area"] * (h * w)
    bh = jnp.round(jnp.sqrt(target * ratio)).astype(jnp.int32)
    bw = jnp.round(jnp.sqrt(target / ratio)).astype(jnp.int32)
    fits = (bh < h) & (bw < w)
    first = jnp.argmax(fits, axis=1)  # the first attempt that fits (0 if none; masked below)
    bh = jnp.take_along_axis(bh, first[:, None], 1)[:, 0]
    bw = jnp.take_along_axis(bw, first[:, None], 1)[:, 0]
    erase = (params["apply"] < prob) & fits.any(axis=1)
    top = jnp.minimum(jnp.floor(params["top"] * (h - bh + 1)).astype(jnp.int32), h - bh)
    left = jnp.minimum(jnp.floor(params["left"] * (w - bw + 1)).astype(jnp.int32), w - bw)
    return erase, top, left, bh, bw


def apply(images: jax.Array, params: dict[str, jax.Array], cfg: EraseConfig) -> jax.Array:
    _, h, w, _ = images.shape
    erase, top, left, bh, bw = boxes(h, w, params, cfg.prob)
    ys, xs = jnp.arange(h)[None, :, None], jnp.arange(w)[None, None, :]
    c = lambda v: v[:, None, None]  # noqa: E731
    inside = ((ys >= c(top)) & (ys < c(top + bh)) & (xs >= c(left)) & (xs < c(left + bw))
              & c(erase))[..., None]
    fill = jnp.zeros_like(images) if cfg.mode == "const" else jnp.broadcast_to(
        params["noise"].astype(images.dtype), images.shape)
    return jnp.where(inside, fill, images)


def erase(key: jax.Array, images: jax.Array, cfg: EraseConfig) -> jax.Array:
    return apply(images, draw(key, images.shape, cfg), cfg)

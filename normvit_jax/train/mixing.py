"""Mixup and CutMix on device, with timm's ``Mixup`` semantics, inside the jitted train step.

The partner of row i is row B-1-i (the flipped batch, timm's convention). Modes:
  batch: one (lam, mixup-or-cutmix, box) for the whole batch;
  pair:  one draw per pair (i, B-1-i), both rows use it (each gets the other's pixels);
  elem:  one draw per row.
A row is mixed with probability ``prob``; when both alphas are > 0 it uses CutMix with probability
``switch_prob``, else Mixup. CutMix's box is timm's ``rand_bbox``: centre (cy, cx) uniform over the
image, cut = ``int(size * sqrt(1 - lam))``, rows ``[cy - cut//2, cy + cut//2)`` ('even': timm up
to 1.0.28 and DeiT's pinned 0.3.2, so an odd cut loses a row) or ``[cy - cut//2, cy + (cut+1)//2)``
('exact': timm 1.0.29 and later), clipped to the image; lam is corrected to
``1 - box area / image area``.

``groups`` > 1 draws per slice of the batch as timm does per GPU process (or per micro-batch of
gradient accumulation): the batch is split into ``groups`` consecutive slices, each with its own
draws and its own flipped partner rows.
Targets are ``lam * onehot(y) + (1 - lam) * onehot(y[::-1])``; label smoothing is applied to these
soft targets by ``steps.cross_entropy``, which is the same as timm's ``mixup_target`` (linear).

Randomness is split into ``draw`` (the parameters of every row, from a key) and ``apply`` (pure
arithmetic), so tests can check ``apply`` against a numpy reference fed the same draws.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("batch", "pair", "elem")
BOXES = ("even", "exact")


@dataclasses.dataclass(frozen=True)
class MixConfig:
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: str = "batch"
    box: str = "even"
    groups: int = 1

    @property
    def enabled(self) -> bool:
        return self.prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)


def validate(config: Any) -> None:
    for key in ("mixup_alpha", "cutmix_alpha"):
        if config[key] < 0:
            raise ValueError(f"config.{key}={config[key]} must be >= 0 (0: off)")
    for key in ("mix_prob", "switch_prob"):
        if not 0.0 <= config[key] <= 1.0:
            raise ValueError(f"config.{key}={config[key]} must be in [0, 1]")
    for key, accepted in (("mix_mode", MODES), ("cutmix_box", BOXES)):
        if config[key] not in accepted:
            raise ValueError(f"config.{key}={config[key]!r} is not known; accepted: {list(accepted)}")
    if not isinstance(config.mix_groups, int) or config.mix_groups < 1:
        raise ValueError(f"config.mix_groups={config.mix_groups!r} must be an int >= 1")
    on = config.mix_prob > 0 and (config.mixup_alpha > 0 or config.cutmix_alpha > 0)
    if on and config.batch_size % (2 * config.mix_groups):
        raise ValueError(f"config.batch_size={config.batch_size} must be a multiple of 2 x "
                         f"config.mix_groups={config.mix_groups} with Mixup/CutMix (row i of a group "
                         "is mixed with its row n-1-i)")


def from_config(config: Any) -> MixConfig:
    validate(config)
    return MixConfig(float(config.mixup_alpha), float(config.cutmix_alpha), float(config.mix_prob),
                     float(config.switch_prob), str(config.mix_mode), str(config.cutmix_box),
                     int(config.mix_groups))


def draw(key: jax.Array, batch: int, h: int, w: int, cfg: MixConfig) -> dict[str, jax.Array]:
    """Per-row raw draws, each shape (batch,): 'lam' (1 where not mixed), 'cutmix' (bool), and the
    box centre 'cy' in [0, h), 'cx' in [0, w)."""
    if batch % 2:
        raise ValueError(f"mixup/cutmix need an even batch, got {batch}")
    n = {"batch": 1, "pair": batch // 2, "elem": batch}[cfg.mode]
    k_apply, k_switch, k_mix, k_cut, k_y, k_x = jax.random.split(key, 6)
    if cfg.mixup_alpha > 0 and cfg.cutmix_alpha > 0:
        cutmix = jax.random.uniform(k_switch, (n,)) < cfg.switch_prob
    else:
        cutmix = jnp.full((n,), cfg.cutmix_alpha > 0)
    beta = lambda k, a: jax.random.beta(k, a, a, (n,)) if a > 0 else jnp.ones((n,))  # noqa: E731
    lam_mix, lam_cut = beta(k_mix, cfg.mixup_alpha), beta(k_cut, cfg.cutmix_alpha)
    lam = jnp.where(cutmix, lam_cut, lam_mix)
    lam = jnp.where(jax.random.uniform(k_apply, (n,)) < cfg.prob, lam, 1.0)
    out = {"lam": lam, "cutmix": cutmix, "cy": jax.random.randint(k_y, (n,), 0, h),
           "cx": jax.random.randint(k_x, (n,), 0, w)}
    if cfg.mode == "batch":
        return {k: jnp.broadcast_to(v, (batch,)) for k, v in out.items()}
    if cfg.mode == "pair":  # row B-1-i shares the draw of row i
        return {k: jnp.concatenate([v, v[::-1]]) for k, v in out.items()}
    return out


def rand_bbox(h: int, w: int, lam: jax.Array, cy: jax.Array, cx: jax.Array, box: str = "even"
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(y_lo, y_hi, x_lo, x_hi) of timm's ``rand_bbox`` for given centres (broadcasts); ``box``:
    'even' (timm <= 1.0.28) or 'exact' (timm >= 1.0.29), see the module docstring."""
    ratio = jnp.sqrt(1.0 - lam)
    cut_h = jnp.floor(h * ratio).astype(jnp.int32)
    cut_w = jnp.floor(w * ratio).astype(jnp.int32)
    up = 1 if box == "exact" else 0
    yl, yh = jnp.clip(cy - cut_h // 2, 0, h), jnp.clip(cy + (cut_h + up) // 2, 0, h)
    xl, xh = jnp.clip(cx - cut_w // 2, 0, w), jnp.clip(cx + (cut_w + up) // 2, 0, w)
    return yl, yh, xl, xh


def apply(images: jax.Array, labels: jax.Array, params: dict[str, jax.Array], num_classes: int,
          box: str = "even") -> tuple[jax.Array, jax.Array]:
    """Mixed images (B, H, W, C) and float32 soft targets (B, num_classes) for the draws."""
    _, h, w, _ = images.shape
    lam, cutmix = params["lam"], params["cutmix"]
    yl, yh, xl, xh = rand_bbox(h, w, lam, params["cy"], params["cx"], box)
    cut_lam = 1.0 - ((yh - yl) * (xh - xl)).astype(jnp.float32) / (h * w)
    lam = jnp.where(cutmix & (lam < 1.0), cut_lam, lam)
    partner = images[::-1]
    ys, xs = jnp.arange(h)[None, :, None], jnp.arange(w)[None, None, :]
    inside = ((ys >= yl[:, None, None]) & (ys < yh[:, None, None])
              & (xs >= xl[:, None, None]) & (xs < xh[:, None, None]))[..., None]
    lam_x = lam.astype(images.dtype)[:, None, None, None]
    blended = images * lam_x + partner * (1 - lam_x)
    mixed = jnp.where(cutmix[:, None, None, None], jnp.where(inside, partner, images), blended)
    mixed = jnp.where((params["lam"] < 1.0)[:, None, None, None], mixed, images)
    onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    targets = lam[:, None] * onehot + (1.0 - lam[:, None]) * onehot[::-1]
    return mixed, targets


def mix(key: jax.Array, images: jax.Array, labels: jax.Array, cfg: MixConfig, num_classes: int
        ) -> tuple[jax.Array, jax.Array]:
    """Draws and applies: (mixed images, soft targets); per slice when ``cfg.groups`` > 1."""
    b, h, w = images.shape[:3]
    if cfg.groups == 1:
        return apply(images, labels, draw(key, b, h, w, cfg), num_classes, cfg.box)
    g = cfg.groups
    if b % (2 * g):
        raise ValueError(f"mixup/cutmix in {g} groups need a batch that is a multiple of {2 * g}, got {b}")
    split = lambda x: x.reshape((g, b // g) + x.shape[1:])  # noqa: E731
    one = lambda k, im, lb: apply(im, lb, draw(k, b // g, h, w, cfg), num_classes, cfg.box)  # noqa: E731
    mixed, targets = jax.vmap(one)(jax.random.split(key, g), split(images), split(labels))
    return mixed.reshape(images.shape), targets.reshape((b, num_classes))

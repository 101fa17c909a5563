"""The on-device batch augmentations of the train step, from the config: RandAugment, random
erasing, then Mixup/CutMix (the order of timm/DeiT, where RandAugment and erasing are part of the
per-image transform).

``make`` returns None when all are off, so the default train step is unchanged bit for bit. The
key comes from the step's key (``fold_in(state.rng, step)``) folded with ``STREAM``, so a resumed
run draws the same ops, boxes and lambdas, and dropout's key is not touched.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from normvit_jax.data.dataspec import DataSpec
from normvit_jax.train import erasing, mixing, randaugment

STREAM = 0x6D6978  # folded into the step key; dropout uses the step key itself
RA_STREAM = 0x7261  # RandAugment's stream, beside STREAM
BatchTransform = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def validate(config: Any, data_spec: DataSpec) -> None:
    mixing.validate(config)
    erasing.from_config(config)
    randaugment.from_config(config, data_spec)


def make(config: Any, data_spec: DataSpec) -> BatchTransform | None:
    """``transform(step_key, images, labels) -> (images, labels or soft targets)``, or None.
    ``data_spec``: the run's ``data.DataSpec`` (classes, value range)."""
    mix_cfg, erase_cfg = mixing.from_config(config), erasing.from_config(config)
    ra_cfg = randaugment.from_config(config, data_spec)
    num_classes = data_spec.num_classes
    if not (mix_cfg.enabled or erase_cfg.enabled or ra_cfg is not None):
        return None

    def transform(step_key: jax.Array, images: jax.Array, labels: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
        k_erase, k_mix = jax.random.split(jax.random.fold_in(step_key, STREAM))
        if ra_cfg is not None:  # its own stream: enabling it leaves erasing/mixing draws unchanged
            images = randaugment.augment(jax.random.fold_in(step_key, RA_STREAM), images, ra_cfg)
        if erase_cfg.enabled:
            images = erasing.erase(k_erase, images, erase_cfg)
        if mix_cfg.enabled:
            images, labels = mixing.mix(k_mix, images, labels, mix_cfg, num_classes)
        return images, labels

    return transform

"""ViT with LayerNorm (the baseline). Variants: ``vit_ln.py:demo``, ``:cifar100``, ``:imagenet``,
sizes ``:s16`` etc.; CIFAR-10 from scratch with a ViT-Ti/4 by default."""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({"name": "layernorm", "epsilon": 1e-6})
    return default.apply_variants(c, arg)

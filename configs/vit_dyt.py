"""ViT with DyT (Zhu et al., CVPR 2025) in every norm slot: gamma * tanh(alpha * x) + beta.

Variants as vit_ln.py. Presets ``:dyt_b``, ``:dyt_l``: the paper's ViT-B/L (timm layout, global
average pooling of the patch tokens beside a class token, then fc_norm:
``classifier='token_gap_fc_norm'``) with ConvNeXt's training script
(configs/recipes.py; published ImageNet-1k top-1 DyT 82.5 / 83.6, LN 82.3 / 83.1).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "dyt",
        "alpha_init": 0.5,              # the paper's ViT value
        "affine": True,                 # gamma/beta (fold into the next Dense)
    })
    return default.apply_variants(c, arg, recipes.NORM_FREE)

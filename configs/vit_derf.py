"""ViT with Derf (arXiv 2512.10938) in every norm slot: gamma * erf(alpha * x + s) + beta.

Variants as vit_ln.py. Presets ``:dyt_b``, ``:dyt_l``: the paper's ViT-B/L with DyT's setting as
Derf's ViT/README.md runs it (configs/recipes.py; published ImageNet-1k top-1 Derf 82.8 / 83.8,
LN 82.3 / 83.1).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "derf",
        "alpha_init": 0.5,              # zlab-princeton/Derf ViT/dynamic_erf.py
        "shift_init": 0.0,              # s
        "affine": True,
    })
    return default.apply_variants(c, arg, recipes.NORM_FREE_DERF)

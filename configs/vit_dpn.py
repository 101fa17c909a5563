"""ViT with Dual PatchNorm (Kumar et al. 2023): LayerNorm before and after the patch embedding,
LayerNorm in every other slot.

Presets: ``:bigvision_s16_90ep`` / ``:bigvision_s16_300ep``: big_vision's plain-ViT ImageNet-1k
recipe (configs/recipes.py), the setting DPN adds its two LayerNorms to; ``:deit_s`` etc. also.
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({"name": "layernorm", "epsilon": 1e-6})  # blocks + final
    c.model.patch_norm = "dual"         # LN(PE(LN(patches))); 'pre', 'post', 'post_posemb' also
    return default.apply_variants(c, arg, {**recipes.BIGVISION, **recipes.DEIT})

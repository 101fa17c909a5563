"""ViT with LayerNorm (the baseline). Variants: ``vit_ln.py:demo``, ``:cifar100``, ``:imagenet``,
sizes ``:s16`` etc.; CIFAR-10 from scratch with a ViT-Ti/4 by default.

Presets (configs/recipes.py, values cited there): ``:bigvision_s16_90ep`` (big_vision S/16,
76.5% after 90 epochs), ``:bigvision_s16_300ep``, and the DTN paper's LN baselines ``:deit_t``,
``:deit_s``, ``:deit_b`` (DeiT recipe), and UN's LN baseline ``:t2t_vit_14`` (T2T-ViT-14, 81.5%).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({"name": "layernorm", "epsilon": 1e-6})
    return default.apply_variants(c, arg, {**recipes.BIGVISION, **recipes.DEIT, **recipes.T2T})

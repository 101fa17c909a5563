"""ViT with RMSNorm in every norm slot: x / sqrt(mean_C(x^2) + eps) * scale, no centring."""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "rmsnorm",
        "epsilon": 1e-6,                # as our LayerNorm default (ViT/big_vision convention)
        "use_bias": False,              # RMSNorm has no shift
    })
    return default.apply_variants(c, arg)

"""ViT with GroupNorm on tokens (per sample over C/G channels x T tokens), G = heads by default."""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "groupnorm",
        "groups": ml_collections.config_dict.placeholder(int),  # None: one group per head (DTN repo)
        "epsilon": 1e-5,                # torch GroupNorm's eps
    })
    return default.apply_variants(c, arg)

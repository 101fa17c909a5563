"""ViT with InstanceNorm on tokens (per sample and channel, statistics over the T tokens)."""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "instancenorm",
        "unbiased": False,              # True: variance / (T-1) as the DTN repository's IN baseline
        "epsilon": 1e-5,                # the DTN repository's eps
    })
    return default.apply_variants(c, arg)

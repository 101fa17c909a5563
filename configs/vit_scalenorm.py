"""ViT with ScaleNorm (Nguyen & Salazar 2019): g * x / max(||x||_2, eps), g one scalar = sqrt(C)."""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "scalenorm",
        "epsilon": 1e-5,                # a clamp on the norm, not an addend
        "per_channel": False,           # True: the DTN repository's per-channel g (init sqrt(C))
    })
    return default.apply_variants(c, arg)

"""The seed's dynamic learnable feature normalization (seeds/000, docs/norms.md): a per-token
feature scaling with a learnable affine (z-score, or min-max with ``:minmax``) trained first, handed
over progressively to RepBN, which folds into the next Dense: at inference no norm is left.

Variants as vit_ln.py (``:demo`` decays over 700 of its 880 steps) plus ``minmax`` (N1 = min-max
instead of z-score), e.g. ``vit_dynamic_feature.py:demo,minmax``.
"""
from __future__ import annotations

import ml_collections

from configs import default
from configs.vit_progressive import fit_handover, progressive_norm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    n1 = {"name": "minmax" if "minmax" in parts else "zscore", "epsilon": 1e-6}
    c.model.norm = progressive_norm(n1)
    c = default.apply_variants(c, ",".join(p for p in parts if p != "minmax") or None)
    if "demo" in parts:
        c.model.norm.decay_steps = 700
    else:
        fit_handover(c)                 # 80% of the run, as vit_progressive.py
    return c

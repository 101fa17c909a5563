"""ViT with Unified Normalization (Yang et al. 2022) in every norm slot.

Layer defaults of the reference (window 4, warmup 4000, momentum 0.9, eps 1e-5) with outlier
filtration ON as the reference's ViT (T2T-ViT-14) uses it. ``:demo`` shortens the warmups so the
windowed statistics and the backward ratio r act within the demo's ~1100 steps.

Presets (configs/recipes.py, values cited there): ``:t2t_vit_14``, the paper's own setting:
T2T-ViT-14 (models/t2t_vit.py) with UN in every norm slot, stem included, as the reference's
``T2t_vit_14_all_un1d``, and its training command (published: UN 80.9%, LN 81.5% with
``vit_ln.py:t2t_vit_14``). ``:deit_s``: DeiT's ViT-S recipe with UN (no published number).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "unified",
        "window": 4,                    # forward and backward window; a pair (fp, bp) also works
        "warmup": 4000,                 # steps normalised with the plain batch statistic
        "ratio_warmup": 1000,           # r = 1 while t <= max(ratio_warmup, warmup) (reference: 1000)
        "momentum": 0.9,                # running_var and ema_gz EMA factor
        "epsilon": 1e-5,
        "outlier_filtration": True,     # the reference's T2T-ViT setting (layer default: off)
        "stats_group_size": ml_collections.config_dict.placeholder(int),  # None: global statistics
    })
    c = default.apply_variants(c, arg, {**recipes.DEIT, **recipes.T2T})
    if "demo" in [p.strip() for p in (arg or "").split(",")]:
        c.model.norm.warmup = 200       # the demo trains ~1100 steps
        c.model.norm.ratio_warmup = 300
    return c

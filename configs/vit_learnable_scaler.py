"""ViT without normalization: every norm slot is a LearnableScaler y = scale * x + bias.

Recipe of the reference (batch 2048 ImageNet): LAMB, lr 5e-3, wd 0.02, no warmup, grad clip 14;
set as the default outside ``:demo`` (the demo keeps default.py's AdamW so it trains in a minute).
Presets: ``:paper`` (vit(16, 192, 24): LN 77.14 / LS 78.77) and ``:paper_d36`` (vit(16, 192, 36):
LN 76.2 / LS 79.77), the README's whole command (configs/recipes.py cites each value).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes

PRESETS = {
    "paper": lambda c: recipes.learnable_scaler_paper(c, depth=24),
    "paper_d36": lambda c: recipes.learnable_scaler_paper(c, depth=36),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "learnable_scaler",
        "scale_init": "reference",      # scale ~ N(0, 1) as the released code; 'ones' for scale = 1
    })
    c = default.apply_variants(c, arg, PRESETS)
    if "demo" not in [p.strip() for p in (arg or "").split(",")]:
        c.optimizer.name = "lamb"       # the reference's optimizer
        c.optimizer.learning_rate = 5e-3  # at batch 2048 (3e-3..4e-3 advised for LS)
        c.optimizer.weight_decay = 0.02
        c.optimizer.grad_clip = 14.0
        c.schedule.warmup_steps = 0     # no warmup
    return c

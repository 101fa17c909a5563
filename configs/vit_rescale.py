"""RescaleViT: no normalization. Norm slots are y = x + b - mu0 (mu0 frozen after 8 batches), the
MLP residual is sqrt(i/(i+1)) * x + s/sqrt(L) * MLP(y), and there is no final norm.

Recipe of the reference (CIFAR-10, ViT-B/16 at 224, 20k steps): SGD momentum 0.9, lr 0.05, wd 0,
batch 128, cosine with 500 warmup steps; set as the default outside ``:demo`` (the demo keeps
default.py's AdamW so it trains in a minute); ``:imagenet`` and ``:small32`` take the optimizer but
keep their own batch, warmup and run length.
Preset ``:cifar10_b16``: that whole run (ViT-B/16 at 224 on CIFAR-10: LN 69.7, BN 66.5, GN 65.1,
Rescale 65.2), data and optimizer values cited in configs/recipes.py.
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "rescale",
        "threshold": 8,                 # training batches averaged into mu0 before it freezes
        "warm_bias_scale": 1e-2,        # the bias acts scaled by this during those batches
    })
    c.model.residual_scaling = "rescale"  # sqrt(i/(i+1)) * x + s/sqrt(L) * MLP(y)
    c.model.final_norm = False          # RescaleViT has no final norm
    c = default.apply_variants(c, arg, {"cifar10_b16": recipes.rescale_cifar10_b16})
    parts = [p.strip() for p in (arg or "").split(",")]
    if "demo" not in parts:
        c.optimizer.name = "sgd"
        c.optimizer.momentum = 0.9
        c.optimizer.learning_rate = 0.05
        c.optimizer.weight_decay = 0.0
        c.schedule.name = "cosine"
        # The run's shape only where no variant set its own: ':imagenet' (300 epochs of 1024)
        # and ':small32' (a fixed 300 steps) keep theirs.
        if "imagenet" not in parts and "small32" not in parts:
            c.batch_size = 128
            c.schedule.warmup_steps = 500
            c.total_steps = 20000       # the reference's 20k iterations
    return c

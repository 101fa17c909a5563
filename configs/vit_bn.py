"""ViT with BatchNorm on tokens in every norm slot (per channel over all B*T tokens).

Variants as vit_ln.py: ``:demo``, ``:cifar100``, ``:imagenet``, sizes ``:s16``. Under a sharded
jit the statistics are global (synchronised BN); ``--config.model.norm.stats_group_size=128``
reproduces per-GPU statistics of the PyTorch references.
"""
from __future__ import annotations

import ml_collections

from configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "batchnorm",
        "momentum": 0.9,                # Flax convention (= PyTorch momentum 0.1)
        "epsilon": 1e-5,                # PyTorch BatchNorm1d's eps
        "unbiased_running_var": False,  # True: store n/(n-1) * var as torch (the DTN repository)
        "stats_group_size": ml_collections.config_dict.placeholder(int),  # None: global batch stats
    })
    return default.apply_variants(c, arg)

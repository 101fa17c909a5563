"""ViT with RepBN (SLAB, Guo et al., ICML 2024) in every norm slot: BN(x) + eta * x, which folds
into the next Dense at inference (``python -m normvit_jax.reparam``).

Variants as vit_ln.py (``:demo`` etc.); ``:small32`` (small photos on a CPU) starts eta at 0.1.
Preset ``:slab_deit_t``: SLAB's DeiT-T with RepBN in every slot from the start, its Swin-based
recipe (configs/recipes.py). Published top-1: 73.6%
(xinghaochen/SLAB @0f2a9ed README.md, Checkpoints: ``deit_t_prepbn``, whose model
``deit_tiny_patch16_224_repbn`` in classification/models/deit.py uses RepBN as its norm_layer);
its LayerNorm counterpart DeiT-tiny 72.2% (facebookresearch/deit @4da6691 README_deit.md, Model Zoo).
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "repbn",
        "momentum": 0.9,                # Flax convention (= torch BatchNorm1d momentum 0.1)
        "epsilon": 1e-5,                # torch BatchNorm1d's eps
        "unbiased_running_var": True,   # torch stores the unbiased batch variance
        "eta_init": 1.0,                # eta, the learnable weight of the identity path
        "stats_group_size": ml_collections.config_dict.placeholder(int),  # None: global batch stats
    })
    c = default.apply_variants(c, arg, recipes.SLAB)
    if "small32" in [p.strip() for p in (arg or "").split(",")]:
        # From the start on small photos eta = 1 lets the un-normalised residual stream through
        # every norm slot and the loss diverges; eta = 0.1 trains (docs/norms.md, "RepBN on small
        # photos"). SLAB's ImageNet recipe keeps 1 (the reference's init).
        c.model.norm.eta_init = 0.1
    return c

"""ViT with Dynamic Token Normalization (Shao et al. 2022) in the reference's layout.

DTN in both norm slots of the first depth-2 blocks (10 of 12), which see the patch tokens only;
the class token joins before block depth-2; LayerNorm (eps 1e-5, torch's) in the last two blocks
and the final norm. DTN on every block with the class token under plain LN statistics instead:
``--config.model.cls_token_at_block=0 --config.model.norm_overrides.final.name=dtn`` etc.
Recipe: the presets ``:deit_t`` (ViT-T*, 4 heads), ``:deit_s``, ``:deit_b`` (ViT-B*, 16 heads): DeiT's
ImageNet recipe with every value cited in configs/recipes.py (the ``:imagenet`` variant of
default.py is a lighter DeiT-style setting: the same 300 epochs, batch and lr, without Mixup/CutMix,
RandAugment, erasing, EMA or repeated augmentation). ``:demo`` (depth 4): DTN in blocks 0-1,
class token at block 2.
"""
from __future__ import annotations

import ml_collections

from configs import default, recipes


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = ml_collections.ConfigDict({
        "name": "dtn",
        "mix_mean": True,               # False: the reference's 'dtn_var' (only the variance mixed)
        "ln_unbiased": True,            # LN variance / (C-1) as the reference
        "epsilon": 1e-5,                # also the per-head RMS pre-scaling's eps
        "position_init": "reference",   # near-uniform P as after the released ViT's re-init; 'local': ConViT init
        "locality_strength": 1.0,       # multiplies the position map's kernel under 'local'
        "pool_size": 14,                # grids above 14 that are multiples of 14: pooled as the reference
        "kernel": "xla",                # 'pallas': fused GPU kernels, bfloat16 runs (docs/norms.md)
        "pallas_tiling": None,          # kernel='pallas': 'F:B' channels/targets/warps, None: defaults
    })
    c = default.apply_variants(c, arg, recipes.DEIT)
    # Counted from the end, so `--config.model.depth=N` keeps the layout: DTN in blocks 0..N-3
    # (10 of 12 as the reference; the demo's depth 4: blocks 0-1), the class token joining the
    # last two blocks, which use LayerNorm, as does the final norm.
    c.model.cls_token_at_block = -2     # resolved to depth - 2
    ln = {"name": "layernorm", "epsilon": 1e-5}
    c.model.norm_overrides = ml_collections.ConfigDict({
        "last_2": dict(ln),             # LN in the last two blocks (resolved to blocks_<d-2>_<d>)
        "final": dict(ln),              # LN as the final norm
    })
    return c

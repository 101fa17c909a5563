"""The exact LayerNorm counterpart of any method config or preset: ``ln_counterpart.py:<method>[,
<variants>]`` loads ``configs/vit_<method>.py:<variants>`` and sets every norm-specific model key
back to vit_ln.py's, keeping the recipe and sizes:

    python main.py --config=configs/ln_counterpart.py:dtn,demo --workdir=runs/dtn_ln
    python main.py --config=configs/ln_counterpart.py:dtn,deit_s --workdir=...

LayerNorm with vit_ln's epsilon (for the same preset) in every slot, no per-block overrides, the class token from the
first block, no patch norm or residual scaling, the final norm on, T2T-ViT's stem on model.norm.
Its parameter tree is the vit_ln config's of the same size (tests/test_config_paths.py), which
``--config.model.norm.name=layernorm`` alone does not give (it keeps e.g. DTN's late class token,
its epsilon and its final-block overrides).
"""
from __future__ import annotations

import importlib
import os

import ml_collections

from configs import vit_ln

METHODS = sorted(f[4:-3] for f in os.listdir(os.path.dirname(os.path.abspath(__file__)))
                 if f.startswith("vit_") and f.endswith(".py"))


def to_layernorm(c: ml_collections.ConfigDict, variants: str | None = None
                 ) -> ml_collections.ConfigDict:
    """vit_ln's norm for the same variants (its T2T preset uses T2T's epsilon) where vit_ln has
    them, else vit_ln's default."""
    try:
        ln = vit_ln.get_config(variants)
    except ValueError:  # a preset of this method only (e.g. learnable_scaler's 'paper')
        ln = vit_ln.get_config()
    m = c.model
    m.norm = ml_collections.ConfigDict(ln.model.norm.to_dict())
    m.norm_overrides = ml_collections.ConfigDict()
    m.cls_token_at_block = 0
    m.patch_norm = "none"
    m.residual_scaling = "none"
    m.final_norm = True
    if "stem_norm" in m:  # T2T-ViT's stem: model.norm
        m.stem_norm.name = None
    return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    method, _, variants = (arg or "").partition(",")
    method = method.strip()
    if method not in METHODS:
        raise ValueError(f"ln_counterpart.py:{arg or ''}: name the method first, one of {METHODS} "
                         "(e.g. ln_counterpart.py:dtn,demo)")
    module = importlib.import_module(f"configs.vit_{method}")
    return to_layernorm(module.get_config(variants or None), variants or None)

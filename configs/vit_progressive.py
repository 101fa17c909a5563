"""ViT with progressive LN -> RepBN ("PRepBN", SLAB's LinearNorm) in every norm slot.

lam * LayerNorm(x) + (1 - lam) * RepBN(x), lam from r0 down to 0 over ``decay_steps`` global train
steps after ``warmup_steps`` (norms/progressive.py); evaluation uses RepBN alone, which folds.
``:demo`` decays over 700 of the demo's 880 steps (80%, as the reference's 300,000 of ~375,000),
``:small32`` and the CIFAR runs (the plain config, ``:cifar100``) over 80% of their steps,
ImageNet over the reference's 300,000.
Preset ``:slab_deit_s``: SLAB's DeiT-S, its Swin-based recipe. Published top-1: 80.2%
(xinghaochen/SLAB @0f2a9ed README.md, Checkpoints: ``deit_s_prepbn``); its LayerNorm counterpart
DeiT-small 79.9% (facebookresearch/deit @4da6691 README_deit.md, Model Zoo; the DeiT paper's
table prints 79.8).
"""
from __future__ import annotations

import math

import ml_collections

from configs import default, recipes


def progressive_norm(n1: dict) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({
        "name": "progressive",
        "n1": n1,                       # the norm trained first
        "n2": {"name": "repbn"},        # the norm it becomes (folds at inference)
        "r0": 1.0,                      # N1's weight when the decay starts
        "warmup_steps": 0,              # steps of N1 alone (the reference: 0)
        "decay_steps": 300_000,         # steps over which lam goes r0 -> 0 (reference DeiT-S)
        "schedule": "linear",           # linear | cosine
        "eval_mode": "n2",              # n2 (the reference) | mixture (lam*N1 + (1-lam)*N2 at the step)
        "must_fold": True,              # refuse a setting whose eval does not fold
    })


CIFAR_TRAIN_EXAMPLES = 50_000  # cifar10 and cifar100 'train'


def fit_handover(c: ml_collections.ConfigDict) -> None:
    """The hand-over over 80% of the run, as SLAB's 300,000 of ~375,000 ImageNet steps, where
    the run length is known here: ``total_steps`` (``:small32``) or CIFAR's epochs (the plain
    config, ``:cifar100``). ImageNet keeps the reference's 300,000; on other data the run warns
    at start when the hand-over outlasts it (evaluation uses N2 alone)."""
    if c.total_steps:
        steps = int(c.total_steps)
    elif c.data.name in ("cifar10", "cifar100"):
        steps = math.ceil(c.num_epochs * (CIFAR_TRAIN_EXAMPLES // c.batch_size))
    else:
        return
    c.model.norm.decay_steps = max(1, int(0.8 * steps) - c.model.norm.warmup_steps)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    c.model.norm = progressive_norm({"name": "layernorm", "epsilon": 1e-6})  # SLAB's LN eps
    c = default.apply_variants(c, arg, recipes.SLAB)
    parts = [p.strip() for p in (arg or "").split(",")]
    if "demo" in parts:
        c.model.norm.decay_steps = 700  # 80% of the demo's 880 steps, as 300k of 375k
    else:
        fit_handover(c)
    return c

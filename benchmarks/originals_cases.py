"""The cases of ``benchmarks.originals``: which file of which original repository, with which
options of this project's norm, on which tokens (benchmarks/originals_compare.py runs them)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.originals_compare import Errors, compare, f32, load, load_class, tokens
from benchmarks.originals_compare import Skip  # noqa: F401  (benchmarks.originals catches it)

DTN_DIR = "models/normkit/norms/"
BC = (4, 10, 12)  # (B, T, C) of the token norms without a grid


def _pos_init(name: str, t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """DTN: the local init the original made, plus noise (random weights over offsets up to 338
    would give a one-hot P); other parameters as default."""
    if name == "pos_proj.weight":
        return t + 0.05 * rng.normal(size=t.shape)
    if "weight" in name:
        return 1 + 0.3 * rng.normal(size=t.shape)
    return 0.3 * rng.normal(size=t.shape)


def dtn(src: str, grid: int = 14, only_var: bool = False) -> Errors:
    m = load(src, "DTN", DTN_DIR + "dtn.py")
    c, h = 16, 4
    tmod = m.DTN(c, group_num=h, resolution=(grid, grid), only_var=only_var)
    p = {("scale",): "weight", ("bias",): "bias", ("var_gate",): "var_norm_weight",
         ("pos_proj",): "pos_proj.weight"}
    if not only_var:
        p[("mean_gate",)] = "mean_norm_weight"
    # position_init 'local': the layer's own init (NormSelect's DTN); the released ViT re-inits
    # every Linear afterwards, which the project's default 'reference' reproduces (docs/norms.md).
    cfg = {"name": "dtn_var" if only_var else "dtn", "position_init": "local"}
    return compare(tmod, cfg, dim=c, heads=h,
                   shape=(2, grid * grid, c), grid=(grid, grid), params=p, steps=2,
                   transposed=("pos_proj.weight",), param_init=_pos_init)


def powernorm_reference(src: str, groups: int = 1, steps: int = 6) -> Errors:
    m = load(src, "powernorm", "fairseq/modules/norms/mask_powernorm.py")
    tmod = m.MaskPowerNorm(BC[2], warmup_iters=3)  # one group, as the reference's default
    return compare(tmod, {"name": "powernorm", "warmup": 3, "groups": 1}, dim=BC[2], shape=BC,
                   groups=groups,
                   params={("scale",): "weight", ("bias",): "bias"},
                   stats={("running_phi",): "running_phi", ("ema_gz",): "ema_gz", ("t",): "iters"},
                   steps=steps, call=lambda mod, x: mod(x.transpose(0, 1)).transpose(0, 1))


def powernorm_dtn(src: str, groups: int = 1, steps: int = 6) -> Errors:
    # Stub: the DTN copy's forward calls PowerFunction, which the file renamed PowerFunction_PN
    # (docs/norms.md: it cannot train as released); bound to that class, nothing else changes.
    m = load(src, "DTN", DTN_DIR + "us_powernorm.py")
    m.PowerFunction = m.PowerFunction_PN
    tmod = m.PowerNorm(BC[2], group_num=3, warmup_iters=3)
    return compare(tmod, {"name": "powernorm", "warmup": 3, "groups": "heads", "backward": "dtn"},
                   dim=BC[2], heads=3, shape=BC, params={("scale",): "weight", ("bias",): "bias"},
                   stats={("running_phi",): "running_phi", ("ema_gz",): "ema_gz", ("t",): "iters"},
                   steps=steps, groups=groups)


UN_STATS = {("running_var",): "running_var", ("ema_gz",): "ema_gz", ("buffer_x2",): "buffer_x2",
            ("buffer_gz",): "buffer_gz", ("t",): "iters", ("skips",): "skip_counter"}


def unified(src: str, window: Any = 4, filtration: bool = False, groups: int = 1,
            steps: int = 1010) -> Errors:
    """1010 steps: the original's ratio warm-up (1000) is a constant, so the r-scaled backward
    starts at step 1001. With filtration, steps 1003 and 1006 have one channel 30x larger."""
    m = load(src, "Unified-Normalization",
             "image_classification/models/unified_normalization/unified_normalization.py")
    tmod = m.UN1d(BC[2], window_size=window, warmup_iters=6, outlier_filtration=filtration)

    def inputs(rng, i):
        x = tokens(rng, BC)
        if filtration and i in (1002, 1005):
            x[..., 0] *= 30
        return x
    return compare(tmod, {"name": "unified", "window": window, "warmup": 6,
                          "outlier_filtration": filtration}, dim=BC[2], shape=BC,
                   params={("scale",): "weight", ("bias",): "bias"}, stats=UN_STATS, steps=steps,
                   inputs=inputs, groups=groups)


def repbn(src: str, groups: int = 1) -> Errors:
    m = load(src, "SLAB", "classification/models/prepbn.py")
    return compare(m.RepBN(BC[2]), {"name": "repbn"}, dim=BC[2], shape=BC, groups=groups,
                   params={("eta",): "alpha", ("bn", "scale"): "bn.weight",
                           ("bn", "bias"): "bn.bias"},
                   stats={("bn", "mean"): "bn.running_mean", ("bn", "var"): "bn.running_var"},
                   steps=5, fold=True)


def progressive(src: str) -> Errors:
    """SLAB's LinearNorm(LayerNorm eps 1e-6 -> RepBN), warm 2, 5 decay steps, r0 0.8: lambda
    step by step through the warm-up, the decay and after it."""
    m = load(src, "SLAB", "classification/models/prepbn.py")
    ln = functools.partial(torch.nn.LayerNorm, eps=1e-6)
    tmod = m.LinearNorm(BC[2], norm1=ln, norm2=m.RepBN, warm=2, step=5, r0=0.8)

    def lam(mod):
        return 1.0 if mod.warm > 0 else float(mod.r0 * mod.iter / mod.total_step)
    cfg = {"name": "progressive", "n1": {"name": "layernorm", "epsilon": 1e-6}, "n2": "repbn",
           "warmup_steps": 2, "decay_steps": 5, "r0": 0.8}
    return compare(tmod, cfg, dim=BC[2], shape=BC,
                   params={("n1", "scale"): "norm1.weight", ("n1", "bias"): "norm1.bias",
                           ("n2", "eta"): "norm2.alpha", ("n2", "bn", "scale"): "norm2.bn.weight",
                           ("n2", "bn", "bias"): "norm2.bn.bias"},
                   stats={("n2", "bn", "mean"): "norm2.bn.running_mean",
                          ("n2", "bn", "var"): "norm2.bn.running_var"},
                   steps=9, lam=lam, fold=True)


def batchnorm(src: str, groups: int = 1) -> Errors:
    m = load(src, "DTN", DTN_DIR + "us_instancenorm.py")
    return compare(m.BatchNorm_(BC[2]), {"name": "batchnorm", "unbiased_running_var": True},
                   dim=BC[2], shape=BC, groups=groups,
                   params={("scale",): "weight", ("bias",): "bias"},
                   stats={("mean",): "bn.running_mean", ("var",): "bn.running_var"}, steps=5,
                   fold=True)


def _stateless(src: str, repo: str, path: str, build: Callable, cfg: dict, params: dict,
               heads: int = 2, inputs: Callable | None = None) -> Errors:
    tmod = build(load(src, repo, path))
    return compare(tmod, cfg, dim=BC[2], heads=heads, shape=BC, params=params, inputs=inputs)


def _unsaturated(rng: np.random.Generator, i: int) -> np.ndarray:
    """DyT/Derf: tokens a tenth of the size (channel means 0.25-3), so that alpha * x spans tanh's
    and erf's curved part instead of their flat tails, where every gradient is ~0."""
    return f32(0.1 * tokens(rng, BC))


AFFINE = {("scale",): "weight", ("bias",): "bias"}


def layernorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_layernorm.py", lambda m: m.LayerNorm(BC[2]),
                      {"name": "layernorm", "epsilon": 1e-5}, AFFINE)


def instancenorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_instancenorm.py", lambda m: m.InsNorm(BC[2]),
                      {"name": "instancenorm", "unbiased": True}, AFFINE)


def groupnorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_groupnorm.py",
                      lambda m: m.GroupNorm_(3, BC[2]), {"name": "groupnorm", "groups": "heads"},
                      AFFINE, heads=3)


def scalenorm(src: str) -> Errors:
    return _stateless(src, "DTN", DTN_DIR + "us_scalenorm.py", lambda m: m.ScaleNorm(BC[2]),
                      {"name": "scalenorm", "per_channel": True}, {("g",): "scale"})


def dyt(src: str) -> Errors:
    return _stateless(src, "DyT", "dynamic_tanh.py", lambda m: m.DynamicTanh(BC[2], True),
                      {"name": "dyt"}, {("alpha",): "alpha", **AFFINE}, inputs=_unsaturated)


def derf(src: str) -> Errors:
    return _stateless(src, "Derf", "ViT/dynamic_erf.py", lambda m: m.Dynamic_erf(BC[2], True),
                      {"name": "derf"}, {("alpha",): "alpha", ("shift",): "shift", **AFFINE},
                      inputs=_unsaturated)


def learnable_scaler(src: str) -> Errors:
    # Only the class: the file is part of a vendored timm whose relative imports need the package.
    cls = load_class(src, "LearnableScaler", "timm/layers/norm.py", "LearnableScaler")
    return compare(cls(BC[2]), {"name": "learnable_scaler"}, dim=BC[2], shape=BC,
                   params={("scale",): "a", ("bias",): "b"}, random_init=("a",))


def rescale(src: str, steps: int = 10) -> Errors:
    """10 train calls cross the 8-call warm-up. With 3, the eval forward differs on purpose: the
    original's eval also updates mu0 during its first 8 calls, here eval never changes state."""
    m = load(src, "RescaleViT", "models/rescale_mapping.py")
    return compare(m.Bias1D(BC[2]), {"name": "rescale"}, dim=BC[2], shape=BC,
                   params={("bias",): "_bias"}, stats={("mu0",): "init_mean", ("count",): "count"},
                   steps=steps, fold=steps >= 8)


# name -> (repository, function): the table's rows in order.
CASES: dict[str, tuple[str, Callable[[str], Errors]]] = {
    "dtn": ("DTN", dtn),
    "dtn grid 28 (pooled)": ("DTN", functools.partial(dtn, grid=28)),
    "dtn_var": ("DTN", functools.partial(dtn, only_var=True)),
    "unified": ("Unified-Normalization", unified),
    "unified (3,2) filtration": ("Unified-Normalization",
                                 functools.partial(unified, window=(3, 2), filtration=True)),
    "unified ghost 2x2 (3,2) filtration": ("Unified-Normalization", functools.partial(
        unified, window=(3, 2), filtration=True, groups=2)),
    "powernorm": ("powernorm", powernorm_reference),
    "powernorm DTN copy": ("DTN", powernorm_dtn),
    "powernorm ghost 2x2": ("powernorm", functools.partial(powernorm_reference, groups=2)),
    "powernorm DTN copy ghost 2x2": ("DTN", functools.partial(powernorm_dtn, groups=2)),
    "repbn": ("SLAB", repbn),
    "progressive LN->RepBN": ("SLAB", progressive),
    "repbn ghost 2x2": ("SLAB", functools.partial(repbn, groups=2)),
    "batchnorm": ("DTN", batchnorm),
    "batchnorm ghost 2x2": ("DTN", functools.partial(batchnorm, groups=2)),
    "layernorm": ("DTN", layernorm),
    "instancenorm": ("DTN", instancenorm),
    "groupnorm": ("DTN", groupnorm),
    "scalenorm": ("DTN", scalenorm),
    "dyt": ("DyT", dyt),
    "derf": ("Derf", derf),
    "learnable_scaler": ("LearnableScaler", learnable_scaler),
    "rescale": ("RescaleViT", rescale),
    "rescale eval after 3 calls (documented difference)": (
        "RescaleViT", functools.partial(rescale, steps=3)),
}

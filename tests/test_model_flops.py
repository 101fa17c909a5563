"""Analytic train-step FLOPs (benchmarks/model_flops.py) against hand calculations and against the
kernels of the real model, and the peak table / MFU arithmetic."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import model_flops as mf
from normvit_jax import models


def _hand(d, depth, mlp, patch, image, classes, batch):
    """The formula written out once more: 3 x forward, 2 FLOPs per multiply-add."""
    n = (image // patch) ** 2
    t = n + 1
    block = 2 * t * d * 3 * d + 2 * 2 * t * t * d + 2 * t * d * d + 2 * 2 * t * d * mlp
    fwd = 2 * n * patch * patch * 3 * d + depth * block + 2 * d * classes
    return 3 * batch * fwd


@pytest.mark.parametrize("variant,tflop", [("B/16", 26.98), ("S/16", 7.06)])
def test_published_sizes_at_batch_256(variant, tflop):
    spec = models.spec_of({"variant": variant})
    s = mf.shape_from_spec(spec, image_size=224, num_classes=1000)
    got = mf.train_step_flops(s, 256)
    assert got == _hand(spec.hidden_size, spec.depth, spec.mlp_dim, 16, 224, 1000, 256)
    assert round(got / 1e12, 2) == tflop


def test_linear_flops_are_twice_the_kernel_parameters_per_token():
    """Independent of the formula: every Dense/conv kernel of the model (eval_shape, nothing
    allocated) costs 2 x its size per token it is applied to; add the attention's two products."""
    spec = models.spec_of({"variant": "Ti/16", "depth": 3}, num_classes=10)
    model = models.create(spec)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64, 64, 3))))["params"]
    n, t, d = 16, 17, 192
    linear = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if "kernel" not in name:
            continue
        size = int(np.prod(x.shape))
        linear += 2 * size * (n if "embedding" in name else 1 if "head" in name else t)
    attention = 3 * 2 * (2 * t * t * d)
    s = mf.shape_from_spec(spec, image_size=64, num_classes=10)
    assert sum(mf.forward_flops(s).values()) == pytest.approx(linear + attention, rel=1e-12)


def test_late_class_token_gap_and_pre_logits():
    base = dict(hidden=64, depth=4, heads=2, mlp_dim=128, patch=4, image_size=16, num_classes=5)
    tok, late = mf.VitShape(**base), mf.VitShape(**base, cls_token_at_block=2)
    gap = mf.VitShape(**base, class_token=False)
    per_block = lambda t: 2 * t * 64 * 3 * 64 + 4 * t * t * 64 + 2 * t * 64 * 64 + 4 * t * 64 * 128
    f = lambda s: sum(mf.forward_flops(s).values())
    assert f(tok) - f(late) == 2 * (per_block(17) - per_block(16))
    assert f(tok) - f(gap) == 4 * (per_block(17) - per_block(16))
    rep = mf.VitShape(**base, representation_size=32)
    assert f(rep) - f(tok) == 2 * 64 * 32 + 2 * 32 * 5 - 2 * 64 * 5


def test_dtn_statistics_and_peaks_and_mfu():
    s = mf.VitShape(hidden=192, depth=12, heads=3, mlp_dim=768, patch=4, image_size=32, num_classes=10)
    assert mf.dtn_statistics_flops(s, slots=25) == 25 * 4 * 64 * 64 * 192
    assert mf.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4
    assert mf.peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert mf.peak_tflops("NVIDIA H200", "bfloat16") == 989.4
    assert mf.peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 156.0
    assert mf.peak_tflops("cpu", "float32") is None
    assert mf.mfu(26.98e12, 0.079, 989.4e12) == pytest.approx(0.3452, abs=1e-4)


@pytest.mark.parametrize("overrides", [
    {"variant": "B/16"},
    {"variant": "S/16", "classifier": "gap"},
    {"variant": "Ti/16", "depth": 4, "cls_token_at_block": 2, "representation_size": 64},
])
def test_forward_count_agrees_with_the_analysis_count(overrides):
    """benchmarks' per-part count and analysis/flops.analytic_flops (the report's column) are
    written independently; they must give the same forward FLOPs per image."""
    from normvit_jax.analysis import flops
    spec = models.spec_of(overrides, num_classes=1000)
    s = mf.shape_from_spec(spec, image_size=224, num_classes=1000)
    assert sum(mf.forward_flops(s).values()) == pytest.approx(flops.analytic_flops(spec, 224),
                                                             rel=1e-12)

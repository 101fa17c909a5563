"""Folding the issue-26 norms: RepBN and progressive fold away; DyT, Derf, zscore, minmax fold their
scale/bias and keep their function; the timm ``gap_fc_norm`` and
``token_gap_fc_norm`` classifiers' fc_norm folds too.
Reference: the unfolded model's eval logits, every variable drawn at random (tests/test_reparam.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from normvit_jax import reparam
from tests.test_reparam import IMAGES, eval_logits, random_variables, slot_names, tiny_model_cfg

BLOCK_SLOTS = [f"Transformer/encoderblock_{i}/{s}" for i in range(2)
               for s in ("LayerNorm_0", "LayerNorm_2")]
PROG = {"name": "progressive", "n1": {"name": "zscore"}, "n2": {"name": "repbn"},
        "decay_steps": 10, "must_fold": True}


@pytest.mark.parametrize("norm,extra,stays", [
    ("repbn", {"classifier": "gap_fc_norm"}, None),
    ("progressive", {}, None),
    (PROG, {"classifier": "gap_fc_norm", "scan": True}, None),
    ("dyt", {"classifier": "gap_fc_norm"}, "tanh(alpha * x)"),
    ("dyt", {"classifier": "token_gap_fc_norm"}, "tanh(alpha * x)"),  # DyT's own ViT (class token)
    ("derf", {}, "erf(alpha * x + s)"),
    ("zscore", {"classifier": "gap_fc_norm"}, "per-token statistics"),
    ("minmax", {}, "per-token statistics"),
])
@pytest.mark.usefixtures("float32_matmuls")
def test_folded_logits_equal_unfolded(norm, extra, stays):
    cfg = tiny_model_cfg("x", **extra)
    cfg["norm"] = norm if isinstance(norm, dict) else {"name": norm}
    variables = random_variables(cfg)
    want = eval_logits(cfg, variables, IMAGES)
    spec, folded, report = reparam.fold(cfg, variables)
    got = eval_logits(spec, folded, IMAGES)
    assert np.abs(want).max() > 1.0  # logits of a size where 1e-5 means something
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, np.abs(want).max()))
    final = ("fc_norm" if extra.get("classifier", "").endswith("gap_fc_norm")
             else "Transformer/encoder_norm")
    assert sorted(report.folded) == sorted(BLOCK_SLOTS + [final])
    names = slot_names(folded)
    if stays is None:  # nothing of the norms is left
        assert not report.kept
        assert not any(s in n for n in names for s in ("LayerNorm_", "encoder_norm", "fc_norm"))
        assert {spec.block_norm(i)["name"] for i in range(2)} == {"identity"}
    else:  # the point-wise function / statistics stay, without scale and bias
        assert sorted(p for p, _ in report.kept) == sorted(BLOCK_SLOTS + [final])
        assert all(stays in why for _, why in report.kept)
        slot_leaves = [n for n in names if any(s in n for s in ("LayerNorm_", "norm']"))]
        assert not any(n.endswith(("['scale']", "['bias']")) for n in slot_leaves), slot_leaves
        assert bool(slot_leaves) == (norm in ("dyt", "derf"))  # alpha (and s) stay
        assert spec.block_norm(0)["affine"] is False
    # The check can fail: the same folded model with its Dense layers unfolded differs.
    assert np.abs(eval_logits(spec, {**folded, "params": {
        **folded["params"], "head": variables["params"]["head"]}}, IMAGES) - want).max() > 1e-3


def test_progressive_mixture_and_layernorm_n2_are_kept():
    cfg = tiny_model_cfg("x")
    cfg["norm"] = {"name": "progressive", "n2": "layernorm"}
    _, _, report = reparam.fold(cfg, random_variables(cfg))
    assert not report.folded
    assert [p for p, _ in report.kept] == ["Transformer/encoderblock_0", "Transformer/encoderblock_1",
                                          "Transformer/encoder_norm"]
    assert "progressive" in report.kept[0][1]


@pytest.mark.parametrize("norm", ["repbn", "progressive"])
def test_folded_model_has_no_norm_op_left(norm):
    """The folded eval forward's jaxpr has exactly the equations of the same ViT with 'identity'
    in every slot (benchmarks/fold_ops.py counts them); unfolded it has more (rsqrt among them)."""
    from benchmarks.fold_ops import eval_counts
    cfg = tiny_model_cfg(norm)
    variables = random_variables(cfg)
    ident = tiny_model_cfg("identity")
    want = eval_counts(ident, random_variables(ident), 16, 5)
    unfolded = eval_counts(cfg, variables, 16, 5)
    spec, folded, _ = reparam.fold(cfg, variables)
    got = eval_counts(spec, folded, 16, 5)
    assert unfolded["rsqrt"] > 0 and sum(unfolded.values()) > sum(want.values())
    assert got == want

"""Optimizer pieces: which parameters get weight decay, and the warmup + decay schedules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models
from normvit_jax.train import optimizer
from tests.conftest import tiny_demo_config


def _flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_weight_decay_mask_spares_biases_norms_posemb_and_cls():
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                           "norm": {"name": "dtn"}}, num_classes=3)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    mask = _flat(optimizer.decay_mask(params))
    assert mask["embedding/kernel"] and mask["head/kernel"]
    assert mask["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"]
    assert mask["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"]
    assert mask["Transformer/encoderblock_0/LayerNorm_0/pos_proj"]  # DTN's map: decayed as the reference
    for name in ("cls", "Transformer/posembed_input/pos_embedding", "head/bias",
                 "Transformer/encoderblock_0/LayerNorm_0/scale", "Transformer/encoderblock_0/LayerNorm_0/bias",
                 "Transformer/encoder_norm/scale"):
        assert not mask[name], name


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
def test_schedule_warms_up_linearly_then_decays(name):
    c = tiny_demo_config(**{"schedule.name": name, "schedule.warmup_steps": 10,
                            "optimizer.learning_rate": 0.5, "schedule.end_factor": 0.1})
    lr = optimizer.schedule(c, total_steps=110)
    np.testing.assert_allclose([lr(0), lr(5), lr(10)], [0.0, 0.25, 0.5], rtol=1e-6)
    end = {"cosine": 0.05, "linear": 0.05, "constant": 0.5}[name]
    np.testing.assert_allclose(lr(110), end, rtol=1e-5)
    if name == "cosine":  # halfway through the decay: peak * (end + (1 - end) * 0.5)
        np.testing.assert_allclose(lr(60), 0.5 * (0.1 + 0.9 * 0.5), rtol=1e-5)

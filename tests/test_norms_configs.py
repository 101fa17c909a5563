"""Every norm config builds, initialises and runs one train-like forward/backward on the tiny demo
model (4 blocks, 4 heads, width 64, 8x8 images in 4x4 patches), with the train step's rule for
backward-updated statistics: grads w.r.t. params AND batch_stats, new = mutated + cotangent."""
from __future__ import annotations

import glob
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models

from tests.conftest import REPO_ROOT

# Every configs/vit_<method>.py: a config added for a new norm is tested without editing this file.
CONFIGS = sorted(os.path.basename(p)[:-3]
                 for p in glob.glob(os.path.join(REPO_ROOT, "configs", "vit_*.py")))
# Whether the shipped methods keep running statistics (batch_stats); a config not named here is
# not held to either.
STATEFUL = {"vit_bn", "vit_powernorm", "vit_un", "vit_rescale", "vit_repbn", "vit_progressive",
            "vit_dynamic_feature"}
STATELESS = {"vit_ln", "vit_gn", "vit_in", "vit_rms", "vit_scalenorm", "vit_dtn", "vit_dpn",
             "vit_learnable_scaler", "vit_dyt", "vit_derf"}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_demo_trains_one_step(name):
    config = importlib.import_module(f"configs.{name}").get_config("demo")
    model = models.create(config.model, num_classes=10)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.uniform(size=(4, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray([0, 1, 2, 3])

    # Eager init: its primitives are compiled once and reused by every config after the first.
    variables = model.init(jax.random.PRNGKey(0), images, train=False)
    params, stats = variables["params"], variables.get("batch_stats", {})
    if name in STATEFUL | STATELESS:
        assert bool(stats) == (name in STATEFUL)

    def loss_fn(p, bs):
        logits, mutated = model.apply({"params": p, "batch_stats": bs}, images, train=True,
                                      rngs={"dropout": jax.random.PRNGKey(1)},
                                      mutable=["batch_stats"], step=jnp.int32(1))
        onehot = jax.nn.one_hot(labels, 10)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1)), mutated["batch_stats"]

    def step(p, bs):  # exactly the generic train step's rule (no allow_int needed)
        (loss, mutated), (gp, gs) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, bs)
        return loss, gp, jax.tree.map(jnp.add, mutated, gs)

    # Unoptimised code generation: this test checks wiring, and compiling dominates its time.
    compiled = jax.jit(step).lower(params, stats).compile(
        compiler_options={"xla_backend_optimization_level": 0,
                          "xla_llvm_disable_expensive_passes": True})
    loss, grads, new_stats = compiled(params, stats)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads))
    if stats:
        changed = [not bool(jnp.all(a == b)) for a, b in
                   zip(jax.tree.leaves(new_stats), jax.tree.leaves(stats))]
        assert any(changed)
    logits = model.apply({"params": params, "batch_stats": new_stats}, images, train=False)
    assert logits.shape == (4, 10) and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("variant", [None, "imagenet"])
def test_config_full_size_resolves(name, variant):
    """Non-demo configs validate (model fields, override keys, norm names and options)."""
    config = importlib.import_module(f"configs.{name}").get_config(variant)
    models.create(config.model, num_classes=10)


def test_every_method_config_is_tested():
    assert len(CONFIGS) >= 17 and (STATEFUL | STATELESS) <= set(CONFIGS)


def test_dtn_layout():
    """The reference layout, counted from the end: it follows a depth override."""
    for variant, depth in ((None, 12), ("demo", 4), (None, 16)):
        c = importlib.import_module("configs.vit_dtn").get_config(variant)
        c.model.depth = depth  # what --config.model.depth=N does after get_config
        m = models.spec_of(c.model)
        assert m.cls_token_at_block == depth - 2
        assert set(dict(m.norm_overrides)) == {f"blocks_{depth - 2}_{depth}", "final"}
        assert m.scan_length == depth - 2
    m = c.model.to_dict()
    with pytest.raises(ValueError, match="cls_token_at_block=-2 with depth=2"):
        models.spec_of({**m, "depth": 2, "cls_token_at_block": -2})
    for at in (4, 10):  # after the last block: a head on a constant token, chance accuracy
        with pytest.raises(ValueError, match=f"cls_token_at_block={at} with depth=4"):
            models.spec_of({**m, "depth": 4, "cls_token_at_block": at})
    with pytest.raises(ValueError, match="last_0"):
        models.spec_of({**m, "norm_overrides": {"last_0": {"name": "layernorm"}}})

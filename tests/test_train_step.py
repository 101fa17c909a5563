"""The jitted train step as the loop runs it: one compilation, no host round-trip, donated state,
norm state advanced in the graph, and gradient accumulation equal to the large batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import models, sharding
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

TINY = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32}


def _setup(norm="layernorm", grad_accum=1, batch=8, **model):
    mdl = models.create({**TINY, "norm": {"name": norm}, **model}, 4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))
    lr = optax.constant_schedule(1e-3)
    v = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    state = TrainState.create(v["params"], v.get("batch_stats", {}), tx,
                              jax.random.key_data(jax.random.key(1)))
    mesh = sharding.make_mesh()
    rep, bat = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    shard = jax.tree.map(lambda _: rep, state)
    state = jax.device_put(state, shard)
    # exactly as loop.train_and_evaluate jits it
    step = jax.jit(steps_lib.make_train_step(mdl, tx, lr, grad_accum_steps=grad_accum),
                   in_shardings=(shard, bat), out_shardings=(shard, rep), donate_argnums=0)
    rng = np.random.default_rng(0)
    batches = [sharding.to_global({"image": rng.standard_normal((batch, 8, 8, 3)).astype(np.float32),
                                   "label": rng.integers(0, 4, batch).astype(np.int32)}, mesh)
               for _ in range(4)]
    return step, state, batches


@pytest.mark.parametrize("norm", ["layernorm", "powernorm", "unified"])
def test_compiles_once_no_host_transfer_donated(norm):
    step, state, batches = _setup(norm)
    state, _ = step(state, batches[0])  # the one compilation
    with jax.transfer_guard("disallow"):  # any implicit host<->device copy raises
        for b in batches[1:]:
            old = jax.tree.leaves(state.params)[0]
            state, metrics = step(state, b)
            assert old.is_deleted(), "the state must be donated to the step"
    assert step._cache_size() == 1, "the train step recompiled"
    jax.block_until_ready(metrics)
    if norm != "layernorm":  # the stateful norms' step counters live in batch_stats
        ts = [x for p, x in jax.tree_util.tree_leaves_with_path(state.batch_stats)
              if jax.tree_util.keystr(p).endswith("['t']")]
        assert ts and all(float(t) == 4.0 for t in ts)


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_grad_accumulation_equals_the_large_batch():
    """4 micro-batches of 4 == one batch of 16 for a per-sample norm, to float rounding."""
    step1, s1, _ = _setup(batch=16)
    step4, s4, _ = _setup(grad_accum=4, batch=16)
    rng = np.random.default_rng(3)
    mesh = sharding.make_mesh()
    batch = sharding.to_global({"image": rng.standard_normal((16, 8, 8, 3)).astype(np.float32),
                                "label": rng.integers(0, 4, 16).astype(np.int32)}, mesh)
    for _ in range(2):
        s1, m1 = step1(s1, batch)
        s4, m4 = step4(s4, batch)
        for k in ("loss", "accuracy", "grad_norm"):
            np.testing.assert_allclose(m1.compute()[k], m4.compute()[k], rtol=2e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(s1.params),
                            jax.tree.leaves(s4.params)):
        if "'key'" in jax.tree_util.keystr(path):
            continue  # its exact gradient is 0: Adam amplifies rounding noise (see test_scan)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_remat_gives_the_same_step():
    step_a, sa, batches = _setup()
    _, sb, _ = _setup()
    mdl = models.create({**TINY, "norm": {"name": "layernorm"}}, 4, remat=True)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))
    step_r = jax.jit(steps_lib.make_train_step(mdl, tx, optax.constant_schedule(1e-3)))
    sa, ma = step_a(sa, batches[0])
    sb, mb = step_r(sb, batches[0])
    np.testing.assert_allclose(ma.compute()["loss"], mb.compute()["loss"], rtol=1e-6)
    np.testing.assert_allclose(ma.compute()["grad_norm"], mb.compute()["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("norm", ["powernorm", "unified"])
def test_step_updates_backward_stats_by_the_gradient_rule(norm):
    """The jitted train step's new batch_stats == the forward's updated statistics + the cotangent
    of the loss w.r.t. the input batch_stats (normvit_jax.norms.gradient_rule), computed here
    with plain jax.grad; the backward-updated ema_gz must actually move. Checked at the second
    step: the zero-initialised head gives the norms no gradient at the first."""
    step, state, batches = _setup(norm)
    state, _ = step(state, batches[1])
    mdl = models.create({**TINY, "norm": {"name": norm}}, 4)
    params, stats = jax.tree.map(jnp.copy, (state.params, state.batch_stats))  # state is donated
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    images, labels = batches[0]["image"], batches[0]["label"]

    def loss_of(p, s):
        logits, mutated = mdl.apply({"params": p, "batch_stats": s}, images, train=True,
                                    rngs={"dropout": rng}, mutable=["batch_stats"])
        return jnp.mean(steps_lib.cross_entropy(logits, labels)), mutated["batch_stats"]

    # each one jitted program (op by op, each primitive of the model was compiled alone: seconds)
    _, forward_stats = jax.jit(loss_of)(params, stats)
    cotangent = jax.jit(jax.grad(lambda s: loss_of(params, s)[0]))(stats)
    want = jax.tree.map(lambda m, g: np.asarray(m, np.float64) + np.asarray(g, np.float64),
                        forward_stats, cotangent)
    new_state, _ = step(state, batches[0])
    got = jax.device_get(new_state.batch_stats)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    moved = [np.abs(g).max() for p, g in jax.tree_util.tree_leaves_with_path(got)
             if jax.tree_util.keystr(p).endswith("['ema_gz']")]
    assert moved and min(moved) > 0, "ema_gz was not updated by the backward"

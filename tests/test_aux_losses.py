"""LearnableScaler's feature decay and attention loss (train/aux_losses.py) against float64 numpy
copies of its code (nghiemtuan/LearnableScaler @1750860 timm/models/vision_transformer.py
Block.compute_feature_decay_loss, Attention.compute_extra_loss; train.py:950-958), what the
tiny ViT sows for them, and the train step with them off (unchanged) and on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from normvit_jax import models, preflight
from normvit_jax.models.layers import ATTENTION_MAX, RESIDUAL
from normvit_jax.train import aux_losses
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

TINY = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32}


def ref_feature(x: np.ndarray, threshold: float) -> float:
    """compute_feature_decay_loss: danger = |x|[|x| > t] - t; mean + max, else 0."""
    a = np.abs(x.astype(np.float64))
    danger = a[a > threshold] - threshold
    return float(danger.mean() + danger.max()) if danger.size else 0.0


def ref_feature_grad(x: np.ndarray, threshold: float) -> np.ndarray:
    """d/dx of ref_feature: sign(x)/n on each entry above t, plus sign(x) at the largest one."""
    a = np.abs(x.astype(np.float64))
    above = a > threshold
    g = np.where(above, np.sign(x) / max(above.sum(), 1), 0.0)
    if above.any():
        i = np.unravel_index(np.argmax(np.where(above, a, -np.inf)), x.shape)
        g[i] += np.sign(x[i])
    return g


def ref_attention(attn: np.ndarray) -> float:
    """compute_extra_loss: m = max over keys; 1 - mean(m[m < 0.5]), else 0."""
    m = attn.astype(np.float64).max(-1)
    bad = m[m < 0.5]
    return float(1 - bad.mean()) if bad.size else 0.0


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("threshold,scale", [(200.0, 150.0), (1.5, 1.0), (5.0, 1.0)])
def test_feature_penalty_matches_the_reference(threshold, scale):
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32) * scale
    want = ref_feature(x, threshold)
    got = float(aux_losses.feature_penalty(jnp.asarray(x), threshold))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if threshold == 5.0:  # N(0, 1) never reaches 5 here: the reference's 0 branch
        assert want == 0.0 and got == 0.0
    else:
        assert want > 0


def test_feature_penalty_gradient_matches_the_reference():
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32) * 150.0
    assert (np.abs(x) > 200).sum() > 3
    got = jax.grad(lambda v: aux_losses.feature_penalty(v, 200.0))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), ref_feature_grad(x, 200.0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("temperature", [1.0, 0.3, 0.02])
def test_attention_penalty_matches_the_reference(temperature):
    """Sharp (0.02: every max above 0.5, the 0 branch), mixed (0.3) and flat (1.0) attention."""
    z = np.random.default_rng(2).standard_normal((2, 3, 6, 6)) / temperature
    attn = _softmax(z).astype(np.float32)
    m = attn.max(-1)
    want = ref_attention(attn)
    got = float(aux_losses.attention_penalty(jnp.asarray(m)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if temperature == 0.02:
        assert (m >= 0.5).all() and got == 0.0
    else:
        assert 0 < want < 1


def _model_and_input(**model):
    mdl = models.create({**TINY, "norm": {"name": "layernorm"}, **model}, 4)
    images = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8, 8, 3)), jnp.float32)
    params = mdl.init(jax.random.key(0), images[:1])["params"]
    return mdl, params, images


@pytest.mark.usefixtures("float32_matmuls")
def test_model_sows_the_streams_and_attention_the_reference_reads():
    """The sown 'after_mlp' stream is each block's output, the sown maxima are those of the
    captured attention weights, and the total follows train.py's fd * (fd * sum F + a * sum A)
    over the first attn_extra_loss_layers blocks."""
    mdl, params, images = _model_and_input()
    loss = aux_losses.ExtraLoss(0.1, threshold=0.5, attn_extra_loss=0.03, attn_layers=1)
    _, mutated = mdl.apply({"params": params}, images, train=True, mutable=loss.collections)
    _, captured = mdl.apply({"params": params}, images, capture=True, mutable=["intermediates"],
                            capture_intermediates=True)
    enc, cap = mutated[RESIDUAL]["Transformer"], captured["intermediates"]["Transformer"]
    features, attention = 0.0, 0.0
    for i in range(2):
        blk = f"encoderblock_{i}"
        np.testing.assert_allclose(enc[blk]["after_mlp"][0], cap[blk]["__call__"][0], rtol=1e-6)
        weights = np.asarray(cap[blk]["MultiHeadDotProductAttention_1"]["attention"][0])
        sown_max = mutated[ATTENTION_MAX]["Transformer"][blk]["MultiHeadDotProductAttention_1"]["max"][0]
        np.testing.assert_allclose(sown_max, weights.max(-1), rtol=1e-6)
        features += sum(ref_feature(np.asarray(enc[blk][k][0]), 0.5)
                        for k in ("after_attention", "after_mlp"))
        attention += ref_attention(weights) if i < 1 else 0.0
    assert features > 0 and attention > 0
    want = 0.1 * (0.1 * features + 0.03 * attention)
    np.testing.assert_allclose(float(loss(mutated)), want, rtol=1e-5)


@pytest.mark.usefixtures("float32_matmuls")
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_blocks_give_the_same_loss(remat):
    """model.scan stacks the sown values of blocks 0..k-1: the same loss, block order kept (and
    under activation checkpointing)."""
    from normvit_jax.models import scan_convert
    mdl, params, images = _model_and_input()
    scanned = models.create({**TINY, "norm": {"name": "layernorm"}, "scan": True}, 4, remat=remat)
    loss = aux_losses.ExtraLoss(0.1, threshold=0.5, attn_extra_loss=0.03, attn_layers=1)
    run = lambda m, p: loss(m.apply({"params": p}, images, train=True, mutable=loss.collections)[1])
    np.testing.assert_allclose(float(run(scanned, scan_convert.stack_blocks(params))),
                               float(run(mdl, params)), rtol=1e-5)


def _step_and_state(extra_loss):
    mdl = models.create({**TINY, "norm": {"name": "layernorm"}}, 4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))
    v = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    state = TrainState.create(v["params"], {}, tx, jax.random.key_data(jax.random.key(1)))
    step = jax.jit(steps_lib.make_train_step(mdl, tx, optax.constant_schedule(1e-3),
                                             extra_loss=extra_loss))
    return mdl, tx, step, state


def _batch():
    rng = np.random.default_rng(4)
    return {"image": jnp.asarray(rng.standard_normal((8, 8, 8, 3)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 4, 8), jnp.int32)}


def test_off_by_default_the_step_is_the_plain_cross_entropy_step():
    """default.py's config builds no extra loss, and the step then equals, bit for bit, the
    step of the plain mean cross-entropy written out here (the objective before the option)."""
    assert aux_losses.ExtraLoss.from_config(default.get_config()) is None
    mdl, tx, step, state = _step_and_state(None)
    batch = _batch()

    @jax.jit
    def plain(state):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        ce = lambda p: jnp.mean(steps_lib.cross_entropy(
            mdl.apply({"params": p}, batch["image"], train=True, rngs={"dropout": rng},
                      mutable=["batch_stats", "schedule"])[0], batch["label"]))
        loss, grads = jax.value_and_grad(ce)(state.params)
        updates, _ = tx.update(grads, state.opt_state, state.params)
        return loss, optax.apply_updates(state.params, updates)

    want_loss, want = plain(state)
    new, metrics = step(state, batch)
    assert float(metrics.compute()["loss"]) == float(want_loss)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_on_the_logged_loss_adds_the_extra_term():
    """With the losses on, the step's loss = cross-entropy + the extra loss of the same forward."""
    loss = aux_losses.ExtraLoss(0.1, threshold=0.5, attn_extra_loss=0.03, attn_layers=2)
    mdl, _, step, state = _step_and_state(loss)
    _, _, step_off, _ = _step_and_state(None)
    batch = _batch()
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    _, mutated = mdl.apply({"params": state.params}, batch["image"], train=True,
                           rngs={"dropout": rng}, mutable=loss.collections)
    extra = float(loss(mutated))
    assert extra > 0
    off = float(step_off(jax.tree.map(jnp.copy, state), batch)[1].compute()["loss"])
    on = float(step(state, batch)[1].compute()["loss"])
    np.testing.assert_allclose(on, off + extra, rtol=1e-5)


def test_attention_loss_alone_is_refused():
    c = default.get_config()
    c.attn_extra_loss = 0.03
    for check in (preflight.check_values, aux_losses.ExtraLoss.from_config):
        with pytest.raises(ValueError, match="attn_extra_loss=0.03 needs config.feature_decay > 0"):
            check(c)
    c.feature_decay = 0.1
    preflight.check_values(c)
    assert aux_losses.ExtraLoss.from_config(c).collections == [RESIDUAL]  # no layers: no maxima
    c.feature_decay = -1.0
    with pytest.raises(ValueError, match="config.feature_decay=-1.0 is out of range"):
        preflight.check_values(c)

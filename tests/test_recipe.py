"""Training-recipe pieces in the optimizer: weight EMA (against the numpy recurrence), layer-wise
lr decay (against a hand-computed table), and the loop with every recipe key on (exact resume,
eval of the EMA weights)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import checkpoints, models
from normvit_jax.train import ema, layer_decay, loop, optimizer
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState
from tests.conftest import tiny_demo_config

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")

TINY = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32}


def _flat(tree):
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _state(config, model_extra=None):
    mdl = models.create({**TINY, **(model_extra or {})}, 4)
    tx, lr = optimizer.create(config, total_steps=20)
    v = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    state = TrainState.create(v["params"], v.get("batch_stats", {}), tx,
                              jax.random.key_data(jax.random.key(1)))
    return mdl, tx, lr, state


def test_ema_follows_the_numpy_recurrence():
    d = 0.9
    cfg = tiny_demo_config(ema_decay=d)
    mdl, tx, lr, state = _state(cfg, {"depth": 1})  # the recurrence is per leaf: one block
    step = jax.jit(steps_lib.make_train_step(mdl, tx, lr))
    rng = np.random.default_rng(0)
    ref = {k: np.asarray(v, np.float64) for k, v in _flat(state.params).items()}
    np.testing.assert_array_equal(_flat(ema.find(state.opt_state))["head/kernel"],
                                  _flat(state.params)["head/kernel"])
    for _ in range(6):
        batch = {"image": rng.standard_normal((8, 8, 8, 3)).astype(np.float32),
                 "label": rng.integers(0, 4, 8).astype(np.int32)}
        state, _ = step(state, batch)
        ref = {k: d * ref[k] + (1 - d) * np.asarray(p, np.float64)
               for k, p in _flat(state.params).items()}
    got = _flat(ema.find(state.opt_state))
    assert got.keys() == ref.keys()
    moved = 0
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
        moved += not np.allclose(got[k], _flat(state.params)[k])
    assert moved > len(ref) // 2  # the EMA lags the weights


@pytest.mark.parametrize("norm", ["batchnorm", "powernorm"])
def test_ema_averages_norm_statistics_as_timm_model_ema(norm):
    """timm ModelEmaV2/V3 average every float entry of the state_dict, buffers included:
    ema_b <- d * ema_b + (1 - d) * b after each step, from the initial values (numpy float64 here
    from the trajectory of the real train step). ``averaged`` evaluates with both EMAs;
    ema_batch_stats=False keeps the raw statistics (the behaviour before)."""
    d = 0.8
    # one block: the averages are per leaf, and a block holds every kind of statistic
    mdl, tx, lr, state = _state(tiny_demo_config(ema_decay=d), {"norm": {"name": norm}, "depth": 1})
    step = jax.jit(steps_lib.make_train_step(mdl, tx, lr))
    rng = np.random.default_rng(1)
    ref = {k: np.asarray(v, np.float64) for k, v in _flat(state.batch_stats).items()}
    ref_p = {k: np.asarray(v, np.float64) for k, v in _flat(state.params).items()}
    assert ref  # the norm keeps statistics
    for _ in range(5):
        batch = {"image": (rng.standard_normal((8, 8, 8, 3)) * 2 + 0.5).astype(np.float32),
                 "label": rng.integers(0, 4, 8).astype(np.int32)}
        state, _ = step(state, batch)
        ref = {k: d * ref[k] + (1 - d) * np.asarray(b, np.float64)
               for k, b in _flat(state.batch_stats).items()}
        ref_p = {k: d * ref_p[k] + (1 - d) * np.asarray(p, np.float64)
                 for k, p in _flat(state.params).items()}
    avg = ema.averaged(state)
    got = _flat(avg.batch_stats)
    assert got.keys() == ref.keys()
    lagging = 0
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        lagging += not np.allclose(got[k], _flat(state.batch_stats)[k])
    assert lagging  # the statistics moved and their EMA lags them
    for k, v in _flat(avg.params).items():
        np.testing.assert_allclose(v, ref_p[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # off: the EMA weights are evaluated with the raw statistics, and the tree keeps none
    mdl, tx, lr, off = _state(tiny_demo_config(ema_decay=d, ema_batch_stats=False),
                              {"norm": {"name": norm}, "depth": 1})
    assert not any("ema_batch_stats" in k for k in _flat(off.opt_state))
    assert ema.averaged(off).batch_stats is off.batch_stats


def test_ema_off_keeps_the_optimizer_state_tree():
    _, _, _, plain = _state(tiny_demo_config())
    assert ema.find(plain.opt_state) is None
    assert not any("ema" in k for k in _flat(plain.opt_state))


def test_old_checkpoint_without_ema_fails_clearly(tmp_path):
    _, _, _, old = _state(tiny_demo_config())
    mngr = checkpoints.make_manager(str(tmp_path), async_save=False)
    checkpoints.save(mngr, 1, old)
    mngr.wait_until_finished()
    _, _, _, new = _state(tiny_demo_config(ema_decay=0.99))
    with pytest.raises(checkpoints.CheckpointMismatchError, match="keeps no EMA of the weights but config.ema_decay > 0"):
        checkpoints.restore_latest(mngr, new)
    mngr.close()


def test_layer_decay_table_for_a_tiny_model():
    """depth 2, decay 0.5: embeddings 0.5^3, block 0 0.5^2, block 1 0.5, head/final norm 1."""
    d = 0.5
    params = models.create({**TINY, "representation_size": 8}, 4).init(
        jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    got = _flat(layer_decay.scales(params, d))
    table = {"embedding/kernel": d ** 3, "embedding/bias": d ** 3, "cls": d ** 3,
             "Transformer/posembed_input/pos_embedding": d ** 3,
             "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel": d ** 2,
             "Transformer/encoderblock_0/LayerNorm_0/scale": d ** 2,
             "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/kernel": d,
             "Transformer/encoderblock_1/LayerNorm_2/bias": d,
             "Transformer/encoder_norm/scale": 1.0, "pre_logits/kernel": 1.0,
             "head/kernel": 1.0, "head/bias": 1.0}
    for k, v in table.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    for k, v in got.items():  # every leaf is in one of the four groups
        assert v in (d ** 3, d ** 2, d, 1.0), k


def test_layer_decay_gives_the_t2t_stem_the_embeddings_scale():
    """BEiT's rule: the stem that makes the tokens is layer 0. T2T-ViT's tokens-to-token module
    (its patch embedding) got layer depth + 1, the head's full learning rate, instead of the
    smallest scale."""
    d, depth = 0.5, 2
    model = models.create({"name": "t2t_vit", "variant": "T2T-7", "depth": depth}, 4)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    got = _flat(layer_decay.scales(params, d))  # the scales need the tree only, not the values
    stem = [k for k in got if k.startswith("tokens_to_token/")]
    assert len(stem) > 10
    for k in stem + ["cls", "Transformer/posembed_input/pos_embedding"]:
        assert got[k] == pytest.approx(d ** (depth + 1), rel=1e-12), k
    assert got["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"] == pytest.approx(d ** depth)
    assert got["head/kernel"] == 1.0


def test_layer_decay_scales_the_updates_and_supports_scan():
    """SGD without momentum/decay/clip: update = -lr * scale * grad, per leaf; a scanned stack
    (3 blocks in Transformer/encoderblock) gets the scale of each block on its slice."""
    d = 0.7
    over = {"optimizer.name": "sgd", "optimizer.momentum": 0.0, "optimizer.weight_decay": 0.0,
            "optimizer.grad_clip": 0.0, "schedule.name": "constant", "schedule.warmup_steps": 0,
            "optimizer.learning_rate": 0.1}
    mdl = models.create({**TINY, "depth": 3, "scan": True}, 4)
    params = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
    tx, _ = optimizer.create(tiny_demo_config(layer_decay=d, **over), total_steps=10)
    upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    flat = _flat(upd)
    scanned = [k for k in flat if k.startswith("Transformer/encoderblock/")]
    assert scanned, "the model was expected to be scanned"
    for k in scanned:
        want = -0.1 * d ** (3 - np.arange(3))  # blocks 0, 1, 2 -> layers 1, 2, 3 of depth 3
        np.testing.assert_allclose(flat[k].reshape(3, -1), np.broadcast_to(
            want[:, None], (3, flat[k][0].size)), rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(flat["embedding/kernel"], -0.1 * d ** 4, rtol=1e-6)
    np.testing.assert_allclose(flat["head/kernel"], -0.1, rtol=1e-6)
    with pytest.raises(ValueError, match="layer_decay"):
        optimizer.create(tiny_demo_config(layer_decay=1.5), total_steps=10)


def test_loop_with_the_recipe_resumes_exactly_and_evaluates_the_ema(tmp_path):
    """RandAugment, Mixup/CutMix, random erasing, EMA and layer decay on: 6 steps straight ==
    3 + 3 (params and EMA bitwise), and eval reports the EMA weights beside the raw ones."""
    cfg = tiny_demo_config(total_steps=6, checkpoint_every=100, eval_every=100, ema_decay=0.9,
                           layer_decay=0.75, mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode="elem",
                           random_erase_prob=0.5, randaugment="rand-m9-mstd0.5-inc1",
                           **{"model.depth": 1})  # still 3 layer-decay scales: stem, block, head
    straight = loop.train_and_evaluate(cfg, str(tmp_path / "a"))
    assert {"ema_top1", "ema_loss", "top1"} <= set(straight["eval"])
    loop.train_and_evaluate(cfg, str(tmp_path / "b"), stop_at=3)
    resumed = loop.train_and_evaluate(cfg, str(tmp_path / "b"))
    a, b = checkpoints.load_state(str(tmp_path / "a"))[0], checkpoints.load_state(str(tmp_path / "b"))[0]
    assert _flat(a).keys() == _flat(b).keys() and any("ema_params" in k for k in _flat(a))
    for k, v in _flat(a).items():
        np.testing.assert_array_equal(v, _flat(b)[k], err_msg=k)
    assert straight["eval"]["ema_top1"] == resumed["eval"]["ema_top1"]

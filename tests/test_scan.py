"""``model.scan``: the scanned and unrolled models compute the same function, and checkpoints
convert between the two layouts exactly (normvit_jax/models/scan_convert.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import models
from normvit_jax.models import scan_convert
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

TINY = {"variant": "Ti/4", "depth": 3, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32}
LAYOUTS = {
    "layernorm": {},
    "rescale": {"norm": {"name": "rescale"}, "residual_scaling": "rescale", "final_norm": False},
    # the DTN reference layout: DTN blocks 0-1 (patch tokens only), class token and LN from block 2
    "dtn_reference": {"norm": {"name": "dtn"}, "cls_token_at_block": 2,
                      "norm_overrides": {"blocks_2_3": {"name": "layernorm"},
                                         "final": {"name": "layernorm"}}},
    "powernorm": {"norm": {"name": "powernorm", "warmup": 1}},
    "unified_sandwich": {"norm": {"name": "unified", "warmup": 1, "window": 2},
                         "norm_placement": "sandwich"},
    # per-process statistics, as the DeiT/UN/SLAB presets set them (configs/recipes.py): ghost
    # groups of one sample each, so the grouping is visible in the outputs
    "batchnorm_ghost": {"norm": {"name": "batchnorm", "stats_group_size": 1}},
    "repbn_ghost": {"norm": {"name": "repbn", "stats_group_size": 1}},
    # timm's global_pool='avg' with its class token (DyT's, Derf's ViTs), pre- and post-norm
    "token_gap_fc_norm_dyt": {"norm": {"name": "dyt"}, "classifier": "token_gap_fc_norm"},
    "token_gap_fc_norm_post": {"classifier": "token_gap_fc_norm", "norm_placement": "post"},
}


def _pair(extra):
    cfg = {**TINY, **extra}
    return cfg, models.create(cfg, 4), models.create({**cfg, "scan": True}, 4)


def scan_length(model_cfg):
    return models.spec_of(model_cfg).scan_length


def _scanned(cfg):
    return models.spec_of({**cfg, "scan": True})


def _x(n=2):
    return jax.random.normal(jax.random.key(0), (n, 8, 8, 3))


def _eval_and_train(model, v, **kwargs):
    """``model.apply`` in eval and in train mode (no dropout; the updated variables of ``mutable``)
    as one jitted program: op by op, each apply of the scanned model compiled its scan again."""
    mutable = kwargs.pop("mutable")
    return jax.jit(lambda v: (model.apply(v, _x(), **kwargs),
                              model.apply(v, _x(), train=True, mutable=mutable, **kwargs)))(v)


def _assert_trees_close(a, b, **tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scanned_and_unrolled_give_the_same_outputs(name):
    cfg, unrolled, scanned = _pair(LAYOUTS[name])
    v = unrolled.init(jax.random.key(1), _x())
    vs = scan_convert.to_layout(v, _scanned(cfg))
    assert jax.tree.structure(vs) == jax.tree.structure(
        jax.eval_shape(lambda: scanned.init(jax.random.key(1), _x())))
    k = scan_length(cfg)
    stacked = vs["params"]["Transformer"]["encoderblock"]
    assert all(leaf.shape[0] == k for leaf in jax.tree.leaves(stacked))
    eval_s, (out_s, st_s) = _eval_and_train(scanned, vs, mutable=["batch_stats"])
    _assert_trees_close(unrolled.apply(v, _x()), eval_s, rtol=1e-6, atol=1e-6)
    # training forward (no dropout): outputs and every updated running statistic agree
    out_u, st_u = unrolled.apply(v, _x(), train=True, mutable=["batch_stats"])
    np.testing.assert_allclose(out_u, out_s, rtol=1e-6, atol=1e-6)
    _assert_trees_close(scan_convert.to_layout(st_u, _scanned(cfg)), st_s,
                        rtol=1e-5, atol=1e-6)


# The norms of issue 26 (norms/*.py): every block's variables random (init values are equal in
# every block, which would hide a block mixed up by the layout conversion); progressive at step 2
# of a decay that starts at step 1, so both N1 and N2 run and N1's weight (0.75) is sown.
NEW_NORMS = {
    "repbn": {"name": "repbn"},
    "progressive": {"name": "progressive", "warmup_steps": 1, "decay_steps": 4},
    "progressive_mixture": {"name": "progressive", "n1": "zscore", "warmup_steps": 1,
                            "decay_steps": 4, "eval_mode": "mixture"},
    "zscore": {"name": "zscore"},
    "minmax": {"name": "minmax"},
    "dyt": {"name": "dyt"},
    "derf": {"name": "derf"},
}


def _randomized(v, seed=3):
    """Every float leaf plus N(0, 0.1^2) noise: each block's values differ, the scale of the
    initialisation is kept (running variances, init 1, stay positive)."""
    leaves, treedef = jax.tree.flatten(v)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x for k, x in zip(keys, leaves)])


def _assert_close_to_scale(a, b, rel=3e-5):
    """Every leaf: max |a - b| <= rel * max |a|. Float32 rounding scales with the largest values
    a leaf is computed from (RepBN's identity path grows the activations to ~100 over 3 blocks;
    seen: up to 1.1e-5 in its running variances, <= 2e-6 in logits, as BatchNorm's); a block's
    variables mixed up by the layout give differences of order 1."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=0, atol=rel * np.abs(x).max(),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
@pytest.mark.parametrize("name", list(NEW_NORMS))
def test_new_norms_scanned_and_unrolled_agree(name):
    """Same variables in both layouts: the same eval and train logits, updated running statistics
    and sown schedule values (``_assert_close_to_scale``)."""
    cfg, unrolled, scanned = _pair({"norm": NEW_NORMS[name]})
    assert scan_length(cfg) == 3
    v = _randomized(unrolled.init(jax.random.key(1), _x()))
    vs = scan_convert.to_layout(v, _scanned(cfg))
    assert jax.tree.structure(vs) == jax.tree.structure(
        jax.eval_shape(lambda: scanned.init(jax.random.key(1), _x())))
    step = {"step": jnp.asarray(2, jnp.int32)}
    mutable = ["batch_stats", "schedule"]
    out_s, (train_s, st_s) = _eval_and_train(scanned, vs, mutable=mutable, **step)
    out_u = unrolled.apply(v, _x(), **step)
    assert float(jnp.std(out_u)) > 1e-2  # the logits depend on the input: a real comparison
    _assert_close_to_scale(out_u, out_s)
    out_u, st_u = unrolled.apply(v, _x(), train=True, mutable=mutable, **step)
    out_s = train_s
    _assert_close_to_scale(out_u, out_s)
    if name.startswith("progressive"):
        np.testing.assert_allclose(jax.tree.leaves(st_u["schedule"]), 0.75)
    if "batch_stats" in v:  # RepBN (also as progressive's N2): the statistics moved
        assert not np.allclose(jax.tree.leaves(st_u["batch_stats"])[0],
                               jax.tree.leaves(v["batch_stats"])[0])
    _assert_close_to_scale(scan_convert.to_layout(st_u, _scanned(cfg)), st_s)


def test_scan_lengths():
    assert scan_length(TINY) == 3
    assert scan_length({**TINY, **LAYOUTS["dtn_reference"]}) == 2
    assert scan_length({**TINY, "norm_overrides": {"block_1": {"name": "rmsnorm"}}}) == 1
    assert scan_length({**TINY, "norm_overrides": {"final": {"name": "rmsnorm"}}}) == 3
    assert scan_length({**TINY, "cls_token_at_block": 2, "classifier": "gap"}) == 3


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_train_steps_match_and_state_converts_both_ways():
    """Two optimizer steps of the scanned model == of the unrolled one (PowerNorm: its state and
    its backward-updated statistics go through the scan); the whole TrainState converts."""
    cfg, unrolled, scanned = _pair({"norm": {"name": "powernorm", "warmup": 1}})
    tx = optax.adamw(1e-2)
    lr = optax.constant_schedule(1e-2)
    v = unrolled.init(jax.random.key(1), _x())
    state_u = TrainState.create(v["params"], v["batch_stats"], tx, jax.random.key_data(jax.random.key(2)))
    state_s = scan_convert.to_layout(state_u, _scanned(cfg))
    step_u = jax.jit(steps_lib.make_train_step(unrolled, tx, lr))
    step_s = jax.jit(steps_lib.make_train_step(scanned, tx, lr))
    batch = {"image": _x(4), "label": jnp.array([0, 1, 2, 3])}
    for _ in range(2):
        state_u, m_u = step_u(state_u, batch)
        state_s, m_s = step_s(state_s, batch)
        np.testing.assert_allclose(m_u.compute()["loss"], m_s.compute()["loss"], rtol=1e-5)
    # The key bias's exact gradient is 0 (softmax is shift invariant): its rounding noise, which
    # Adam scales up to lr-sized steps, differs between the layouts; every other leaf agrees.
    back = scan_convert.unstack_blocks(state_s)
    assert jax.tree.structure(back) == jax.tree.structure(state_u)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(state_u)):
        if "'key'" not in jax.tree_util.keystr(path):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    back = scan_convert.stack_blocks(scan_convert.unstack_blocks(state_s))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state_s)):
        np.testing.assert_array_equal(a, b)


def test_flat_npz_keys_convert_both_ways():
    flat = {"Transformer/encoderblock_0/LayerNorm_0/scale": np.zeros(4),
            "Transformer/encoderblock_1/LayerNorm_0/scale": np.ones(4),
            "Transformer/encoderblock_2/LayerNorm_0/scale": np.full(4, 2.0),
            "Transformer/encoder_norm/scale": np.ones(4), "head/kernel": np.ones((4, 3))}
    stacked = scan_convert.stack_blocks(flat, 2)
    assert stacked["Transformer/encoderblock/LayerNorm_0/scale"].shape == (2, 4)
    assert "Transformer/encoderblock_2/LayerNorm_0/scale" in stacked
    assert scan_convert.is_scanned(stacked) and not scan_convert.is_scanned(flat)
    back = scan_convert.unstack_blocks(stacked)
    assert back.keys() == flat.keys()
    for k in flat:
        np.testing.assert_array_equal(back[k], flat[k])


def test_bad_stacking_is_named():
    with pytest.raises(ValueError, match="blocks \\[1, 2\\]"):
        scan_convert.stack_blocks({"encoderblock_1": {"a": np.zeros(1)},
                                   "encoderblock_2": {"a": np.zeros(1)}})


def test_scanned_drop_path_uses_each_blocks_rate():
    """Block i drops with rate stochastic_depth * i / (depth - 1): block 0 never, so with a rate
    of 1 at the last block some samples keep blocks 0..1 and lose the last block's branches."""
    cfg, unrolled, scanned = _pair({"stochastic_depth": 0.5})
    v = scan_convert.to_layout(unrolled.init(jax.random.key(1), _x()), _scanned(cfg))
    v["params"]["head"]["kernel"] = jax.random.normal(jax.random.key(5), (16, 4))  # init: zeros
    eval_out = scanned.apply(v, _x(8))
    outs = [scanned.apply(v, _x(8), train=True, rngs={"dropout": jax.random.key(s)}) for s in range(3)]
    assert all(bool(jnp.all(jnp.isfinite(o))) for o in outs)
    assert not np.allclose(outs[0], eval_out) and not np.allclose(outs[0], outs[1])


def test_scan_with_remat_and_capture():
    cfg, unrolled, _ = _pair({})
    scanned = models.create({**cfg, "scan": True}, 4, remat=True)
    v = scan_convert.to_layout(unrolled.init(jax.random.key(1), _x()), _scanned(cfg))
    logits, inter = scanned.apply(v, _x(), capture=True, mutable=["intermediates"])
    att = inter["intermediates"]["Transformer"]["encoderblock"]["MultiHeadDotProductAttention_1"]
    assert att["attention"][0].shape == (3, 2, 2, 5, 5)  # stacked: (depth, B, H, T, T)
    grads = jax.grad(lambda p: jnp.sum(scanned.apply({"params": p}, _x(), train=True)))(v["params"])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))

"""Optimizer pieces: which parameters get weight decay, and the warmup + decay schedules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import models
from normvit_jax.train import optimizer
from tests.conftest import tiny_demo_config


def _flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init(model):
    """The model's parameters, initialised in one jitted program (op by op, each primitive of each
    shape compiled alone, took seconds more; the same values)."""
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]


def test_weight_decay_mask_spares_biases_norms_posemb_and_cls():
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                           "norm": {"name": "dtn"}}, num_classes=3)
    params = _init(model)
    mask = _flat(optimizer.decay_mask(params))
    assert mask["embedding/kernel"] and mask["head/kernel"]
    assert mask["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"]
    assert mask["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"]
    assert mask["Transformer/encoderblock_0/LayerNorm_0/pos_proj"]  # DTN's map: decayed as the reference
    for name in ("cls", "Transformer/posembed_input/pos_embedding", "head/bias",
                 "Transformer/encoderblock_0/LayerNorm_0/scale", "Transformer/encoderblock_0/LayerNorm_0/bias",
                 "Transformer/encoder_norm/scale"):
        assert not mask[name], name


@pytest.mark.parametrize("name", optimizer.OPTIMIZERS)
def test_every_optimizer_applies_the_decay_mask(name):
    """decay_mask is right (above) AND each optimizer uses it: with zero gradients the only
    update is the weight decay, so the no-decay parameters (norm scales and biases, biases,
    cls, position embedding) must not move while the matrices do."""
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2},
                          num_classes=3)
    params = _init(model)
    params = jax.tree.map(lambda a: a + 0.5, params)  # no zero leaf: decay moves every one
    c = tiny_demo_config(**{"optimizer.name": name, "optimizer.weight_decay": 0.1,
                            "optimizer.learning_rate": 0.01, "schedule.name": "constant",
                            "schedule.warmup_steps": 0})
    tx, _ = optimizer.create(c, total_steps=10)
    # one jitted program, as the train step runs it (op by op it compiled each primitive alone)
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    mask = _flat(optimizer.decay_mask(params))
    moved = {k: bool(np.any(np.asarray(u) != 0)) for k, u in _flat(updates).items()}
    assert moved == mask, {k: (moved[k], mask[k]) for k in mask if moved[k] != mask[k]}
    assert any(mask.values()) and not all(mask.values())


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_weight_decay_moves_only_the_matrices_scanned_or_not(scan):
    """With zero gradients AdamW's update is the weight decay alone: it must move the kernels and
    DTN's position map (the matrices) and nothing else. The expectation is by name, not from
    decay_mask. Before: the q/k/v biases ((heads, head_dim), one vector in timm) were decayed, and
    in a scanned model (a leading depth axis) every block's biases and norm gains too."""
    model = models.create({"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2,
                           "norm": {"name": "dtn"}, "scan": scan}, num_classes=3)
    params = _init(model)
    params = jax.tree.map(lambda a: a + 0.5, params)  # no zero leaf: decay moves every one
    assert ("Transformer/encoderblock/LayerNorm_0/scale" in _flat(params)) == scan
    c = tiny_demo_config(**{"optimizer.name": "adamw", "optimizer.weight_decay": 0.1,
                            "optimizer.learning_rate": 0.01, "schedule.name": "constant",
                            "schedule.warmup_steps": 0})
    tx, _ = optimizer.create(c, total_steps=10)
    # one jitted program, as the train step runs it (op by op it compiled each primitive alone)
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    moved = {k: bool(np.any(np.asarray(u) != 0)) for k, u in _flat(updates).items()}
    want = {k: k.rsplit("/", 1)[-1] in ("kernel", "pos_proj") for k in moved}
    assert moved == want, {k: moved[k] for k in moved if moved[k] != want[k]}


@pytest.mark.parametrize("name", optimizer.OPTIMIZERS)
def test_scanned_model_gets_the_unrolled_models_updates(name):
    """model.scan stacks each block parameter on a leading depth axis; the optimizer must still
    treat every block's slice as its own parameter. LAMB's trust ratio ||w|| / ||update|| was taken
    over all the blocks at once (optax.scale_by_trust_ratio on the stacked leaf): updates ~4% off
    the unrolled model's. Three steps, random weights and gradients, weight decay on."""
    from normvit_jax.models import scan_convert
    cfg = {"variant": "Ti/4", "depth": 3, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32}
    # only the shapes: every value is drawn below (nothing to compile)
    params = jax.eval_shape(models.create(cfg, 3).init, jax.random.key(0),
                            jnp.zeros((1, 8, 8, 3)))["params"]
    r = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
    grads = [jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
             for _ in range(3)]
    spec = models.spec_of({**cfg, "scan": True}, 3)
    c = tiny_demo_config(**{"optimizer.name": name, "optimizer.weight_decay": 0.05,
                            "schedule.name": "constant", "schedule.warmup_steps": 0})
    tx, _ = optimizer.create(c, total_steps=10)
    pu, su = params, tx.init(params)
    ps = scan_convert.to_layout(params, spec)
    ss = tx.init(ps)
    assert "Transformer/encoderblock/LayerNorm_0/scale" in _flat(ps)
    update = jax.jit(tx.update)  # as the train step runs it; compiled once per layout
    for g in grads:
        uu, su = update(g, su, pu)
        us, ss = update(scan_convert.to_layout(g, spec), ss, ps)
        pu, ps = optax.apply_updates(pu, uu), optax.apply_updates(ps, us)
        back = _flat(scan_convert.unstack_blocks(us))
        for k, u in _flat(uu).items():
            np.testing.assert_allclose(back[k], u, rtol=1e-5, atol=1e-9, err_msg=k)


def test_lamb_optax_is_optax_lamb_on_an_unrolled_model():
    """'lamb_optax' is optax.lamb's chain with a trust ratio that knows scanned leaves: on an
    unrolled model the same state tree and the same updates, bit for bit."""
    params = _init(models.create({"variant": "Ti/4", "depth": 2, "hidden_size": 16,
                                  "num_heads": 2}, num_classes=3))
    r = np.random.default_rng(1)
    grads = jax.tree.map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
    c = tiny_demo_config(**{"optimizer.name": "lamb_optax", "optimizer.weight_decay": 0.05,
                            "optimizer.grad_clip": None, "schedule.name": "constant",
                            "schedule.warmup_steps": 0})
    tx, lr = optimizer.create(c, total_steps=10)
    ref = optax.lamb(lr, b1=c.optimizer.b1, b2=c.optimizer.b2, weight_decay=0.05,
                     mask=optimizer.decay_mask)
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(ref.init(params))
    # each one jitted program, as the train step runs it (op by op, each primitive compiled alone)
    got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    want, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


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


def _timm_lamb_numpy(params, grads_seq, decay, lr, wd, b1=0.9, b2=0.999, eps=1e-6, max_norm=1.0):
    """timm/optim/lamb.py ``Lamb.step`` in float64: global-norm clip, Adam moments with bias
    correction, L2 decay and trust ratio only in the weight-decay group."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t, g in enumerate(grads_seq, start=1):
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values()))
        clip = norm / max_norm if norm > max_norm else 1.0
        for k in p:
            gk = g[k].astype(np.float64) / clip
            m[k] = b1 * m[k] + (1 - b1) * gk
            v2[k] = b2 * v2[k] + (1 - b2) * gk * gk
            update = (m[k] / (1 - b1 ** t)) / (np.sqrt(v2[k]) / np.sqrt(1 - b2 ** t) + eps)
            group_wd = wd if decay[k] else 0.0
            if group_wd:
                update = update + group_wd * p[k]
                w_n, u_n = np.linalg.norm(p[k]), np.linalg.norm(update)
                update = update * (w_n / u_n if w_n > 0 and u_n > 0 else 1.0)
            p[k] = p[k] - lr * update
        out.append({k: x.copy() for k, x in p.items()})
    return out


def test_lamb_is_timms_rule_trust_ratio_only_where_weight_decay_applies():
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.normal(size=(6, 5)).astype(np.float32),
                        "bias": rng.normal(size=(5,)).astype(np.float32)},
              "cls": rng.normal(size=(1, 1, 5)).astype(np.float32),
              "scale": rng.normal(size=(5,)).astype(np.float32)}
    flat = lambda t: {k: np.asarray(v) for k, v in _flat(t).items()}  # noqa: E731
    mask = flat(optimizer.decay_mask(params))
    assert mask == {"dense/kernel": True, "dense/bias": False, "cls": False, "scale": False}
    # Gradient norms around the clip (1.0): some steps are clipped, some not.
    grads = [jax.tree.map(lambda x: (rng.normal(size=x.shape) * s).astype(np.float32), params)
             for s in (0.05, 3.0, 0.2, 1.5, 0.1)]
    c = tiny_demo_config(**{"optimizer.name": "lamb", "optimizer.learning_rate": 0.01,
                            "optimizer.weight_decay": 0.02, "optimizer.grad_clip": None,
                            "schedule.name": "constant", "schedule.warmup_steps": 0})
    tx, _ = optimizer.create(c, total_steps=10)
    want = _timm_lamb_numpy(flat(params), [flat(g) for g in grads], mask, 0.01, 0.02)
    p, state = params, tx.init(params)
    for g, w in zip(grads, want):
        updates, state = tx.update(g, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
        got = flat(p)
        for k in w:
            np.testing.assert_allclose(got[k], w[k], rtol=2e-5, atol=1e-6, err_msg=k)
    # optax.lamb ('lamb_optax') scales the no-decay parameters too: a different update there.
    c.optimizer.name = "lamb_optax"
    tx2, _ = optimizer.create(c, total_steps=10)
    u2, _ = tx2.update(grads[0], tx2.init(params), params)
    u1, _ = tx.update(grads[0], tx.init(params), params)
    assert not np.allclose(np.asarray(u1["scale"]), np.asarray(u2["scale"]), rtol=1e-3)


def _ls_custom_reference(epoch, num_epochs, factor, epoch_threshold):
    """nghiemtuan/LearnableScaler train.py ``custom_lr_scheduler``, as published."""
    cur_cos_value = (1 + np.cos(np.pi * epoch / num_epochs)) / 2
    n_epochs = epoch_threshold * num_epochs
    cos_value_threshold1 = (1 + np.cos(np.pi * n_epochs / num_epochs)) / 2
    final_period = int(num_epochs * 0.66)
    cos_value_threshold2 = (1 + np.cos(np.pi * final_period / num_epochs)) / 2
    if epoch < n_epochs:
        return factor * cur_cos_value
    elif epoch < final_period:
        a = (factor * cos_value_threshold1 - cos_value_threshold2) / (n_epochs - final_period)
        b = factor * cos_value_threshold1 - a * n_epochs
        return a * epoch + b
    return cur_cos_value


@pytest.mark.parametrize("epochs,factor,threshold", [(300, 0.8, 0.5), (37, 0.6, 0.3)])
def test_ls_custom_schedule_is_the_reference_per_epoch(epochs, factor, threshold):
    spe = 7  # steps per epoch
    c = tiny_demo_config(**{"schedule.name": "ls_custom", "schedule.warmup_steps": 0,
                            "optimizer.learning_rate": 5e-3, "num_epochs": float(epochs),
                            "schedule.epoch_factor": factor, "schedule.epoch_threshold": threshold})
    lr = jax.jit(optimizer.schedule(c, total_steps=epochs * spe))
    steps = np.arange(epochs * spe)
    want = [5e-3 * _ls_custom_reference(s // spe, epochs, factor, threshold) for s in steps]
    np.testing.assert_allclose(np.asarray(lr(steps)), want, rtol=2e-5, atol=1e-9)
    # a step function of the epoch, continuous where the pieces meet (the reference's design)
    assert float(lr(spe * (epochs // 2) + 3)) == float(lr(spe * (epochs // 2)))


def test_a_warmup_longer_than_the_run_is_shortened_with_one_warning(tmp_path, caplog):
    """schedule.warmup_steps=10000 in a 6-step run warmed up over 5 steps without a word; now
    one warning line at start names both values and what is used (and a fitting one says
    nothing). The logged learning rate is the shortened schedule's: the peak at step 5."""
    from normvit_jax import summaries
    from normvit_jax.train import loop
    cfg = tiny_demo_config(total_steps=6, log_every=1, checkpoint_every=6, eval_every=6,
                           **{"model.depth": 1, "schedule.warmup_steps": 10000})
    with caplog.at_level("WARNING"):
        loop.train_and_evaluate(cfg, str(tmp_path / "long"))
    lines = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert lines == ["config.schedule.warmup_steps=10000 is not shorter than the run's 6 steps: "
                     "the learning rate warms up over 5 steps instead (the peak at step 5, then "
                     "1 step(s) of cosine decay); set warmup_steps below total_steps to choose"]
    peak, sched = cfg.optimizer.learning_rate, optimizer.schedule(cfg, 6)
    np.testing.assert_allclose([float(sched(s)) for s in range(6)],
                               [peak * s / 5 for s in range(6)], rtol=1e-6)  # peak at step 5
    logged = [p[1] for p in summaries.read_scalars(str(tmp_path / "long"))["train/learning_rate"]]
    assert max(logged) == pytest.approx(peak, rel=1e-6)  # the run used that schedule
    caplog.clear()
    assert optimizer.warmup_note(tiny_demo_config(total_steps=6), 6) is None  # warmup 2: as written
    assert optimizer.warmup_note(tiny_demo_config(**{"schedule.warmup_steps": 6}), 6) is not None

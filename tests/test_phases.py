"""Issue 32, point 2: the train step compiled per phase of a progressive hand-over
(train/phases.py): N1 alone in the warm-up, N2 alone once lam is 0 (N1 not computed), the mix
without a branch in between; each equals the one step that reads the step number on the device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import models
from normvit_jax.train import phases
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

WARMUP, DECAY = 2, 3


def _model(n1: str = "layernorm", n2: str = "repbn", **layout):
    # one block: each phase's step and the hand-over are the same in every block
    cfg = {"hidden_size": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32, "patch_size": 4,
           "norm": {"name": "progressive", "warmup_steps": WARMUP, "decay_steps": DECAY,
                    "n1": n1, "n2": n2},
           "norm_overrides": {"final": "layernorm"}, **layout}
    return models.create(cfg, 3)


def test_phases_start_where_the_schedules_change_and_only_progressive_norms_learn_theirs():
    cfg = {"hidden_size": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32, "patch_size": 4,
           "norm": {"name": "progressive", "warmup_steps": 2, "decay_steps": 3},
           "norm_overrides": {"block_1": {"name": "progressive", "decay_steps": 4},
                              "final": "layernorm"}}
    spec = models.create(cfg, 3).spec
    assert phases.phase_starts(spec) == (0, 2, 4, 5)
    told = phases.spec_for_phase(spec, (4, 5))
    assert [dict(n).get("phase") for n in told.slot_norms] == [(4, 5), (4, 5), None]
    assert [n["name"] for n in told.slot_norms] == [n["name"] for n in spec.slot_norms]
    plain = models.create({**cfg, "norm": "layernorm", "norm_overrides": {}}, 3).spec
    assert phases.phase_starts(plain) == (0,)


def _state(model, images):
    init = jax.jit(lambda k, x: model.init(k, x, train=False))  # compiled once, not op by op
    v = init(jax.random.key(0), images)
    return TrainState.create(v["params"], v["batch_stats"], optax.sgd(0.1),
                             jax.random.key_data(jax.random.key(1)))


# warm-up, hand-over, after; one-pass (LN + RepBN) and two-pass (RMSNorm + BN) mixes; the
# scanned blocks and post-norm layouts
@pytest.mark.parametrize("n1,n2,at,layout", [
    ("layernorm", "repbn", 1, {}), ("layernorm", "repbn", 3, {}), ("layernorm", "repbn", 6, {}),
    ("rmsnorm", "batchnorm", 6, {}), ("layernorm", "repbn", 1, {"scan": True}),
    ("layernorm", "repbn", 6, {"norm_placement": "post"})])
def test_each_phase_step_equals_the_step_that_reads_the_step_number(n1, n2, at, layout):
    model = _model(n1, n2, **layout)
    rng = np.random.default_rng(at)
    images = jnp.asarray(rng.normal(size=(8, 8, 8, 3)), jnp.float32)
    batch = {"image": images, "label": jnp.asarray(rng.integers(0, 3, 8))}
    tx = optax.sgd(0.1)
    state = _state(model, images).replace(step=jnp.asarray(at, jnp.int32))
    made = {}

    def make(m):
        made[m] = jax.jit(steps_lib.make_train_step(m, tx, optax.constant_schedule(0.1)))
        return made[m]

    phased = phases.PhasedTrainStep(make, model)
    s_any, m_any = phased(state, batch)
    s_at, m_at = phased.at(at)(state, batch)
    assert phased.at(at) is not made[model]  # its own compiled step
    assert float(m_at.compute()["norm_n1_weight"]) == float(m_any.compute()["norm_n1_weight"])
    # the one-pass mix (LN + RepBN) with weight 0 rounds differently from N2 alone: 1e-6
    for a, b in zip(jax.tree.leaves((s_any.params, s_any.batch_stats)),
                    jax.tree.leaves((s_at.params, s_at.batch_stats))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(m_at.compute()["loss"]), float(m_any.compute()["loss"]),
                               rtol=1e-6)


def test_after_the_hand_over_n1_is_not_computed():
    """The step compiled for the phase after the hand-over does less work than the step that
    computes N1 with weight 0 (XLA's cost analysis, CPU), and as little as N2 alone."""
    model = _model()
    images = jnp.zeros((8, 8, 8, 3), jnp.float32)
    batch = {"image": images, "label": jnp.zeros(8, jnp.int32)}
    tx = optax.sgd(0.1)

    def flops(m) -> float:
        step = jax.jit(steps_lib.make_train_step(m, tx, optax.constant_schedule(0.1)))
        return step.lower(_state(m, images), batch).compile().cost_analysis()["flops"]

    after = models.create(phases.spec_for_phase(model.spec, (WARMUP + DECAY, None)))
    n2_only = models.create({"hidden_size": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32,
                             "patch_size": 4, "norm": "repbn",
                             "norm_overrides": {"final": "layernorm"}}, 3)
    f_any, f_after, f_n2 = flops(model), flops(after), flops(n2_only)
    assert f_after < f_any and f_after == pytest.approx(f_n2, rel=0.02), (f_any, f_after, f_n2)


def test_the_loop_pauses_its_eta_while_the_next_phase_compiles(tmp_path, monkeypatch, caplog):
    """The step after the hand-over compiles inside the loop: that call is an ETA pause, as an
    eval or a save is (the demo's interval over it read 10 steps/s among 45), and one line says
    what the wait is."""
    import contextlib
    import logging

    from normvit_jax.train import loop, progress
    from tests.conftest import tiny_demo_config
    entered = []
    paused = progress.Eta.paused

    @contextlib.contextmanager
    def counting(self, kind=None):
        entered.append(1)
        with paused(self, kind):
            yield

    monkeypatch.setattr(progress.Eta, "paused", counting)
    c = tiny_demo_config(**{"model.norm": {"name": "progressive", "warmup_steps": 0,
                                           "decay_steps": 3}, "checkpoint_every": 6,
                           "model.depth": 1})
    with caplog.at_level(logging.INFO, logger="absl"):
        loop.train_and_evaluate(c, str(tmp_path / "w"))
    # one eval and one save at step 6, and the phase that starts at step 4
    assert len(entered) == 3, len(entered)
    assert caplog.text.count("Compiling the train step of the next phase (from step 4") == 1

"""The train step's logged metrics are those of the update it made (tests/test_train.py covers
the summaries a whole run writes)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import models
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

TINY = {"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2, "mlp_dim": 32,
        "norm": {"name": "layernorm"}}


def _batch(seed: int, nan: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((4, 8, 8, 3)).astype(np.float32)
    if nan:
        image[0, 0, 0, 0] = np.nan
    return {"image": jnp.asarray(image), "label": jnp.asarray(rng.integers(0, 4, 4), jnp.int32)}


@pytest.mark.parametrize("make_tx", [lambda s: optax.adamw(s, weight_decay=0.05),
                                     lambda s: optax.chain(optax.clip_by_global_norm(1.0),
                                                           optax.sgd(s, momentum=0.9))])
def test_logged_learning_rate_is_the_one_the_update_used_after_skipped_steps(make_tx):
    """skip_nonfinite keeps the optimizer state, schedule position included (optax's count
    advances with each update made); the logged learning rate is the schedule at that count, the
    rate the update used (reference: the number of updates made before each step, counted
    here), not at the global step."""
    sched = optax.linear_schedule(0.01, 0.11, 10)  # a different rate at every step
    mdl = models.create(TINY, 4)
    v = mdl.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    tx = make_tx(sched)
    state = TrainState.create(v["params"], {}, tx, jax.random.key_data(jax.random.key(1)))
    step = jax.jit(steps_lib.make_train_step(mdl, tx, sched, skip_nonfinite=True))
    logged = []
    for i, nan in enumerate([False, True, True, False, False]):
        state, m = step(state, _batch(i, nan))
        logged.append(float(m.compute()["learning_rate"]))
    assert int(state.step) == 5
    # two skipped updates: the optimizer's schedule stands at 3 after 5 global steps
    np.testing.assert_allclose(logged, [float(sched(c)) for c in (0, 1, 1, 1, 2)], rtol=1e-6)

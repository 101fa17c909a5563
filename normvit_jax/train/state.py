"""The train state: everything a checkpoint must hold to continue a run exactly."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from normvit_jax.train import ema


@flax.struct.dataclass
class TrainState:
    """step: updates done. rng: raw uint32 key data (checkpointable); per-step keys are
    ``fold_in(key, step)`` so a resumed run draws the same dropout masks. nonfinite_streak:
    consecutive skipped non-finite updates (``config.skip_nonfinite_steps``)."""

    step: jax.Array
    params: Any
    opt_state: Any
    batch_stats: Any
    rng: jax.Array
    nonfinite_streak: jax.Array

    @classmethod
    def create(cls, params: Any, batch_stats: Any, tx: optax.GradientTransformation,
               rng: jax.Array) -> "TrainState":
        opt_state = ema.init_stats(tx.init(params), batch_stats)  # EMA of the statistics, if kept
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                   batch_stats=batch_stats, rng=rng, nonfinite_streak=jnp.zeros((), jnp.int32))

    def variables(self) -> dict[str, Any]:
        v = {"params": self.params}
        if self.batch_stats:
            v["batch_stats"] = self.batch_stats
        return v

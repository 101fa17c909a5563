"""Exponential moving average of the weights (timm's ModelEmaV2, DeiT's model EMA), kept in the
optimizer state: ``ema <- decay * ema + (1 - decay) * params`` after every update, starting from
the initial (or pretrained: ``tx.init`` runs again after ``init_from``) weights, no bias correction.

Living in ``opt_state`` means checkpoints, resume, sharding and skipped non-finite steps (the whole
optimizer state is kept) need nothing new. A checkpoint written without EMA does not restore into a
run with ``ema_decay > 0``: the restore names the missing ``.../ema_params/...`` arrays.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class EmaState(NamedTuple):
    ema_params: Any


def track(decay: float) -> optax.GradientTransformation:
    """Passes the updates through; place it last in the chain (it sees the final updates)."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"config.ema_decay={decay} must be in (0, 1) (0: off)")

    def init(params: Any) -> EmaState:
        return EmaState(jax.tree.map(lambda p: jnp.array(p, dtype=jnp.result_type(p), copy=True),
                                     params))

    def update(updates: Any, state: EmaState, params: Any = None) -> tuple[Any, EmaState]:
        if params is None:
            raise ValueError("the EMA of the weights needs the params in tx.update")
        new = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p.astype(e.dtype),
                           state.ema_params, new)
        return updates, EmaState(ema)

    return optax.GradientTransformation(init, update)


def find(opt_state: Any) -> Any | None:
    """The EMA params inside an optimizer state, or None when the run keeps none."""
    found = [s.ema_params for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, EmaState))
             if isinstance(s, EmaState)]
    return found[0] if found else None

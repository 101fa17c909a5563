"""Optimizers and learning-rate schedules from the config, built on optax."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from normvit_jax.train import ema, layer_decay

OPTIMIZERS = ("adamw", "sgd", "lamb")
SCHEDULES = ("cosine", "linear", "constant")
# Weight decay applies to matrices only: every 1-D parameter (biases, norm gains and shifts, DTN's
# gates) and scalar is exempt, and so are the position embedding and the class token. A norm's own
# matrices (DTN's position map) are decayed, as in the reference code.
_NO_DECAY_NAMES = ("pos_embedding", "cls")


def validate(config: Any) -> None:
    o, s = config.optimizer, config.schedule
    if o.name not in OPTIMIZERS:
        raise ValueError(f"config.optimizer.name={o.name!r} is not known; accepted: {list(OPTIMIZERS)}")
    if s.name not in SCHEDULES:
        raise ValueError(f"config.schedule.name={s.name!r} is not known; accepted: {list(SCHEDULES)}")
    if not o.learning_rate or o.learning_rate <= 0:
        raise ValueError(f"config.optimizer.learning_rate={o.learning_rate!r} must be > 0")
    if s.warmup_steps < 0:
        raise ValueError(f"config.schedule.warmup_steps={s.warmup_steps} must be >= 0")
    if config.get("layer_decay", 1.0) != 1.0:
        layer_decay.scale_by_layer(config.layer_decay)  # raises for a value out of range
    if config.get("ema_decay", 0.0):
        ema.track(config.ema_decay)


def schedule(config: Any, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine/linear decay to ``end_factor * peak``."""
    peak = config.optimizer.learning_rate
    warmup = min(int(config.schedule.warmup_steps), max(total_steps - 1, 0))
    end = peak * config.schedule.end_factor
    decay_steps = max(total_steps - warmup, 1)
    name = config.schedule.name
    if name == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.schedule.end_factor)
    elif name == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: matrices, except the position embedding and class token."""
    def keep(path, leaf) -> bool:
        last = jax.tree_util.keystr(path[-1:], simple=True)
        return leaf.ndim >= 2 and last not in _NO_DECAY_NAMES
    return jax.tree_util.tree_map_with_path(keep, params)


def create(config: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    validate(config)
    o = config.optimizer
    lr = schedule(config, total_steps)
    if o.name == "adamw":
        tx = optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask)
    elif o.name == "lamb":
        tx = optax.lamb(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask)
    else:
        tx = optax.chain(optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                         optax.sgd(lr, momentum=o.momentum or None, nesterov=o.nesterov))
    if o.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), tx)
    # Only when on, so the default optimizer state (and checkpoints) keep their tree.
    if config.get("layer_decay", 1.0) != 1.0:
        tx = optax.chain(tx, layer_decay.scale_by_layer(config.layer_decay))
    if config.get("ema_decay", 0.0):
        tx = optax.chain(tx, ema.track(config.ema_decay))  # last: it sees the final updates
    return tx, lr

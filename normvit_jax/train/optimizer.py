"""Optimizers and learning-rate schedules from the config, built on optax."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from normvit_jax.models import scan_convert
from normvit_jax.train import ema, global_norm, layer_decay

# lamb: timm's Lamb (the LearnableScaler recipe's); lamb_optax: optax.lamb (trust ratio everywhere).
OPTIMIZERS = ("adamw", "sgd", "lamb", "lamb_optax")
SCHEDULES = ("cosine", "linear", "constant", "ls_custom")
# Weight decay applies to matrices only: every 1-D parameter (norm gains and shifts, DTN's gates),
# scalar and bias (attention's q/k/v biases are 2-D here, one vector in timm) is exempt, and so are
# the position embedding and the class token; a scanned block's leaves count without their depth
# axis. A norm's own matrices (DTN's position map) are decayed, as in the reference code.
_NO_DECAY_NAMES = ("pos_embedding", "cls", "bias")


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
    if s.name == "ls_custom" and not 0.0 < s.epoch_threshold < s.final_fraction <= 1.0:
        raise ValueError(f"config.schedule.epoch_threshold={s.epoch_threshold} must be in (0, "
                         f"schedule.final_fraction={s.final_fraction}), which must be <= 1")
    if config.layer_decay != 1.0:
        layer_decay.scale_by_layer(config.layer_decay)  # raises for a value out of range
    if config.ema_decay:
        ema.track(config.ema_decay)


def warmup_steps(config: Any, total_steps: int) -> int:
    """The warmup the schedule uses: ``schedule.warmup_steps``, at most ``total_steps - 1`` (the
    decay gets at least one step, and a warmup longer than the run never reaches the peak)."""
    return min(int(config.schedule.warmup_steps), max(total_steps - 1, 0))


def warmup_note(config: Any, total_steps: int) -> str | None:
    """One line when ``warmup_steps`` shortens the configured warmup (training logs it at start:
    the schedule is then not the one written in the config); None otherwise."""
    asked, used = int(config.schedule.warmup_steps), warmup_steps(config, total_steps)
    if used == asked:
        return None
    return (f"config.schedule.warmup_steps={asked} is not shorter than the run's {total_steps} "
            f"steps: the learning rate warms up over {used} steps instead (the peak at step "
            f"{used}, then {total_steps - used} step(s) of {config.schedule.name} decay); set "
            f"warmup_steps below total_steps to choose")


def schedule(config: Any, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine/linear decay to ``end_factor * peak``."""
    peak = config.optimizer.learning_rate
    warmup = warmup_steps(config, total_steps)
    end = peak * config.schedule.end_factor
    decay_steps = max(total_steps - warmup, 1)
    name = config.schedule.name
    if name == "ls_custom":
        after = ls_custom(peak, decay_steps, config.num_epochs, config.schedule.epoch_factor,
                          config.schedule.epoch_threshold, config.schedule.final_fraction)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.schedule.end_factor)
    elif name == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def ls_custom(peak: float, total_steps: int, num_epochs: float, factor: float, threshold: float,
              final_fraction: float) -> optax.Schedule:
    """LearnableScaler's ``--sched custom`` (nghiemtuan/LearnableScaler train.py,
    ``custom_lr_scheduler``), a step function of the epoch as there (LambdaLR stepped per epoch):
    with c(e) = (1 + cos(pi e / E)) / 2, ``factor * c(e)`` for e < threshold * E, then a line from
    ``factor * c(threshold * E)`` to ``c(int(final_fraction * E))``, then ``c(e)``. The epoch of a
    step is the last e with ``ceil(e * total_steps / E) <= step`` (``step // steps_per_epoch``)."""
    n1 = threshold * num_epochs
    n2 = int(num_epochs * final_fraction)  # int() as the reference
    cos = lambda e: (1.0 + np.cos(np.pi * e / num_epochs)) / 2.0  # noqa: E731
    epochs = np.arange(math.ceil(num_epochs), dtype=np.float64)
    middle = cos(n1) * factor + (factor * cos(n1) - cos(n2)) / (n1 - n2 or 1.0) * (epochs - n1)
    factors = np.where(epochs < n1, factor * cos(epochs), np.where(epochs < n2, middle, cos(epochs)))
    # First step of each epoch, in float64 on the host (float32 step * E / total misrounds).
    starts = np.ceil(epochs * total_steps / num_epochs - 1e-9).astype(np.int32)
    table = jnp.asarray(peak * factors, jnp.float32)

    def lr(step: jax.Array) -> jax.Array:
        e = jnp.searchsorted(jnp.asarray(starts), jnp.asarray(step, jnp.int32), side="right") - 1
        return table[jnp.clip(e, 0, len(starts) - 1)]
    return lr


def timm_lamb(learning_rate: optax.ScalarOrSchedule, b1: float, b2: float, weight_decay: float,
              mask: Callable[[Any], Any], max_grad_norm: float | None = 1.0, eps: float = 1e-6
              ) -> optax.GradientTransformation:
    """timm's ``Lamb`` (timm/optim/lamb.py; the one LearnableScaler trains with): the global
    gradient norm clipped to ``max_grad_norm`` inside the optimizer, Adam moments with bias
    correction, L2 decay added to the update, and the trust ratio ||w|| / ||update|| only where
    the weight decay is non-zero (params with none, under ``mask``, take plain Adam steps, as do all
    when ``weight_decay`` is 0). optax.lamb applies the trust ratio to every parameter."""
    parts = [global_norm.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if weight_decay:
        parts += [optax.add_decayed_weights(weight_decay, mask=mask),
                  optax.masked(scale_by_trust_ratio(), mask)]
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: matrices, except the position embedding and class token.

    The rank is the parameter's own: a scanned model's stacked leaves (under
    ``Transformer/encoderblock``, a leading depth axis) count one axis less, so their biases and
    norm gains stay exempt; a ``bias`` is exempt whatever its rank (attention's q/k/v biases are
    (heads, head_dim): timm's qkv bias, one vector, is not decayed)."""
    def keep(path, leaf) -> bool:
        rank = leaf.ndim - _stacked(path)
        return rank >= 2 and jax.tree_util.keystr(path[-1:], simple=True) not in _NO_DECAY_NAMES
    return jax.tree_util.tree_map_with_path(keep, params)


def _stacked(path: tuple) -> bool:
    """A scanned model's leaf (under ``Transformer/encoderblock``): one parameter per block
    stacked on a leading depth axis."""
    return any(jax.tree_util.keystr((k,), simple=True) == scan_convert.STACKED for k in path)


def scale_by_trust_ratio() -> optax.GradientTransformation:
    """``optax.scale_by_trust_ratio()`` (update * ||param|| / ||update||, 1 where either is 0)
    with the norms of each parameter: each block's slice of a scanned model's stacked leaf is one,
    as in the unrolled model (optax's took the norms over all the blocks at once)."""
    def norm(path: tuple, x: jax.Array) -> jax.Array:
        if not _stacked(path):
            return optax.safe_norm(x, 0.0)
        n = optax.safe_norm(x.reshape(x.shape[0], -1), 0.0, axis=1)
        return n.reshape((-1,) + (1,) * (x.ndim - 1))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("scale_by_trust_ratio needs the params")

        def one(path, u, p):
            pn, un = norm(path, p), norm(path, u)
            ratio = jnp.where(jnp.logical_or(pn == 0.0, un == 0.0), jnp.array(1.0, p.dtype), pn / un)
            return u * ratio
        return jax.tree_util.tree_map_with_path(one, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def create(config: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    validate(config)
    o = config.optimizer
    lr = schedule(config, total_steps)
    if o.name == "adamw":
        tx = optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decay_mask)
    elif o.name == "lamb":
        tx = timm_lamb(lr, o.b1, o.b2, o.weight_decay, decay_mask, o.lamb_grad_clip)
    elif o.name == "lamb_optax":
        # optax.lamb's chain (eps 1e-6), with the per-parameter trust ratio of a scanned model
        tx = optax.chain(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=1e-6),
                         optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                         scale_by_trust_ratio(), optax.scale_by_learning_rate(lr))
    else:
        tx = optax.chain(optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                         optax.sgd(lr, momentum=o.momentum or None, nesterov=o.nesterov))
    if o.grad_clip:
        tx = optax.chain(global_norm.clip_by_global_norm(o.grad_clip), tx)
    # Only when on, so the default optimizer state (and checkpoints) keep their tree.
    if config.layer_decay != 1.0:
        tx = optax.chain(tx, layer_decay.scale_by_layer(config.layer_decay))
    if config.ema_decay:
        # last: it sees the final updates
        tx = optax.chain(tx, ema.track(config.ema_decay, config.ema_batch_stats))
    return tx, lr

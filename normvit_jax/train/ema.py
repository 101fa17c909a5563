"""Exponential moving average of the weights and the norm statistics (timm's ModelEmaV2/V3, DeiT's
model EMA), kept in the optimizer state: ``ema <- decay * ema + (1 - decay) * value`` after every
update, starting from the initial (or pretrained: ``init_stats`` runs again after ``init_from``)
values, no bias correction.

timm averages the model's whole ``state_dict``: parameters and buffers (BatchNorm's running
statistics). Here the buffers are the ``batch_stats`` collection (BN, UN, PowerNorm, RepBN, ...):
with ``config.ema_batch_stats`` (default on) their float entries are averaged the same way and
integer ones (step counters) copied, as ModelEmaV3 does; off, the EMA weights are evaluated with
the raw model's statistics. The train step passes the updated statistics to ``tx.update`` as the
extra argument ``batch_stats``.

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
    ema_batch_stats: Any = None  # None: not averaged; {} until ``init_stats`` fills it


def _copy(x: Any) -> Any:
    return jax.tree.map(lambda p: jnp.array(p, dtype=jnp.result_type(p), copy=True), x)


def _average(decay: float, ema: Any, new: Any) -> Any:
    def one(e, p):
        if not jnp.issubdtype(e.dtype, jnp.floating):
            return jnp.asarray(p, e.dtype)  # counters: the model's value (timm ModelEmaV3)
        return decay * e + (1.0 - decay) * p.astype(e.dtype)
    return jax.tree.map(one, ema, new)


def track(decay: float, batch_stats: bool = True) -> optax.GradientTransformationExtraArgs:
    """Passes the updates through; place it last in the chain (it sees the final updates)."""
    if not 0.0 < decay < 1.0:
        raise ValueError(f"config.ema_decay={decay} must be in (0, 1) (0: off)")

    def init(params: Any) -> EmaState:
        return EmaState(_copy(params), {} if batch_stats else None)

    def update(updates: Any, state: EmaState, params: Any = None, **extra: Any
               ) -> tuple[Any, EmaState]:
        if params is None:
            raise ValueError("the EMA of the weights needs the params in tx.update")
        ema = _average(decay, state.ema_params, optax.apply_updates(params, updates))
        stats = state.ema_batch_stats
        if jax.tree.leaves(stats):
            if extra.get("batch_stats") is None:
                raise ValueError("the EMA of the norm statistics needs tx.update(..., batch_stats=)")
            stats = _average(decay, stats, extra["batch_stats"])
        return updates, EmaState(ema, stats)

    return optax.GradientTransformationExtraArgs(init, update)


def _is_ema(s: Any) -> bool:
    return isinstance(s, EmaState)


def init_stats(opt_state: Any, batch_stats: Any) -> Any:
    """``opt_state`` with the EMA of the statistics starting at ``batch_stats`` (after ``tx.init``)."""
    def fill(s):
        if _is_ema(s) and s.ema_batch_stats is not None:
            return s._replace(ema_batch_stats=_copy(batch_stats))
        return s
    return jax.tree.map(fill, opt_state, is_leaf=_is_ema)


def keeps_stats(opt_state: Any) -> bool:
    """Whether the EMA inside ``opt_state`` averages the norm statistics (``init_stats`` then
    replaces them)."""
    return any(_is_ema(s) and bool(jax.tree.leaves(s.ema_batch_stats))
               for s in jax.tree.leaves(opt_state, is_leaf=_is_ema))


def find(opt_state: Any) -> Any | None:
    """The EMA params inside an optimizer state, or None when the run keeps none."""
    found = [s.ema_params for s in jax.tree.leaves(opt_state, is_leaf=_is_ema) if _is_ema(s)]
    return found[0] if found else None


def averaged(state: Any) -> Any | None:
    """``state`` with the EMA weights (and the EMA statistics when kept), or None without EMA."""
    found = [s for s in jax.tree.leaves(state.opt_state, is_leaf=_is_ema) if _is_ema(s)]
    if not found:
        return None
    stats = found[0].ema_batch_stats
    return state.replace(params=found[0].ema_params,
                         batch_stats=stats if jax.tree.leaves(stats) else state.batch_stats)

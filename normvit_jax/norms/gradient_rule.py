"""The rule for statistics updated in the backward pass (PowerNorm's ema_gz, UN's gz window).

A custom backward cannot write state, so it returns the increment (new - old) of such a
statistic as the cotangent of the statistic's own input. A train step therefore differentiates
the loss with respect to the params AND the input ``batch_stats`` and sets

    new_batch_stats = forward_mutated_batch_stats + cotangent_of_batch_stats

Every other statistic is read through ``stop_gradient`` and gets a zero cotangent; integer
leaves (step counters) get float0 cotangents, which are ignored. ``train_grads`` is the one
implementation: the train step (normvit_jax/train/steps.py) calls it, and the tests check it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax


def merge_state(mutated: Any, cotangent: Any) -> Any:
    """new_batch_stats = mutated + cotangent, leaf by leaf; float0 (integer) cotangents ignored."""
    def add(m, g):
        if g is None or getattr(g, "dtype", None) == jax.dtypes.float0:
            return m
        return m + g.astype(m.dtype)
    return jax.tree.map(add, mutated, cotangent)


def train_grads(apply_fn: Callable[..., Any], params: Any, batch_stats: Any,
                loss_fn: Callable[[Any], jax.Array]) -> tuple[jax.Array, Any, Any, Any]:
    """Loss, parameter gradients and the new batch_stats of one training step.

    apply_fn(variables) must call ``model.apply(variables, ..., train=True,
    mutable=['batch_stats'])`` and return (output, mutated_collections); loss_fn(output) -> scalar.
    An empty ``batch_stats`` (a model without running state) is left out of the variables.
    Returns (loss, grads, new_batch_stats, output).
    """
    def f(p, s):
        out, mutated = apply_fn({"params": p, "batch_stats": s} if s else {"params": p})
        return loss_fn(out), (mutated.get("batch_stats", s), out)

    (loss, (mutated, out)), (grads, stats_ct) = jax.value_and_grad(
        f, argnums=(0, 1), has_aux=True, allow_int=True)(params, batch_stats)
    return loss, grads, merge_state(mutated, stats_ct), out

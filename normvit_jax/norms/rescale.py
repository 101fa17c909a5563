"""RescaleViT's norm slot (after RescaleNet): y = x + b - mu0, no normalization.

The residual scaling that goes with it is the model's ``model.residual_scaling='rescale'``.
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import updating


class Rescale(nn.Module):
    """mu0: running average of the per-channel means over B*T of the first ``threshold`` training
    batches, then frozen; during those calls the bias acts scaled by ``warm_bias_scale`` (1e-2) and
    the freshly updated mu0 is used, as the reference does. State: ``mu0``, ``count``.

    Difference: the reference also updates mu0 in eval mode during its first calls; here eval never
    changes state.
    """

    threshold: int = 8
    warm_bias_scale: float = 1e-2

    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c) with eval output a * x + c per channel: a = 1, c = bias - mu0 (normvit_jax.reparam
        folds it; eval never uses the warm-up bias scale)."""
        c = jnp.asarray(params["bias"]) - jnp.asarray(stats["mu0"])
        return jnp.ones_like(c), c

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        c = x.shape[-1]
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        mu0 = self.variable("batch_stats", "mu0", jnp.zeros, (c,), jnp.float32)
        # float32 counter: jax.grad over batch_stats needs no allow_int.
        count = self.variable("batch_stats", "count", jnp.zeros, (), jnp.float32)
        x32 = x.astype(jnp.float32)
        mu = jax.lax.stop_gradient(mu0.value)
        scale = 1.0
        if updating(self, train):
            n = jax.lax.stop_gradient(count.value)
            warm = n < self.threshold
            batch_mean = jax.lax.stop_gradient(jnp.mean(x32, axis=(0, 1)))
            mu = jnp.where(warm, mu + (batch_mean - mu) / (n + 1), mu)
            scale = jnp.where(warm, self.warm_bias_scale, 1.0)
            mu0.value = mu
            count.value = n + warm.astype(jnp.float32)
        return (x32 + bias * scale - mu).astype(x.dtype)

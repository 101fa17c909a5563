"""Scale-only per-token norms: RMSNorm (Zhang & Sennrich 2019) and ScaleNorm (Nguyen & Salazar 2019)."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import PER_TOKEN_STATS, channel_affine


class RMSNorm(nn.Module):
    """y = scale * x / sqrt(mean_C(x^2) + eps); no centring, no bias unless asked."""

    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason

    epsilon: float = 1e-6
    use_scale: bool = True
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return channel_affine(self, y, self.use_scale, self.use_bias).astype(x.dtype)


class ScaleNorm(nn.Module):
    """y = g * x / max(||x||_2, eps). eps is a clamp, not an addend.

    g is one scalar initialised to sqrt(C) (the paper's reference); ``per_channel=True`` gives
    the DTN repository's per-channel g (same init). Named 'g', not 'scale': LayerNorm's gamma
    (init 1) has another meaning and must not load into it.
    """

    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason

    epsilon: float = 1e-5
    per_channel: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        c = x.shape[-1]
        shape = (c,) if self.per_channel else ()
        g = self.param("g", nn.initializers.constant(math.sqrt(c)), shape, jnp.float32)
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True))
        return (g * x32 / jnp.maximum(norm, self.epsilon)).astype(x.dtype)

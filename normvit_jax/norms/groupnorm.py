"""Per-sample norms on tokens: GroupNorm (Wu & He 2018) and InstanceNorm (over tokens)."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import PER_TOKEN_STATS, NormContext, resolve_groups


def _affine(module: nn.Module, y: jax.Array, use_scale: bool, use_bias: bool) -> jax.Array:
    c = y.shape[-1]
    if use_scale:
        y = y * module.param("scale", nn.initializers.ones, (c,), jnp.float32)
    if use_bias:
        y = y + module.param("bias", nn.initializers.zeros, (c,), jnp.float32)
    return y


class GroupNorm(nn.Module):
    """Per sample and channel group: statistics over (C/G channels x T tokens), biased variance.

    groups defaults to the model's number of heads (the DTN repository's GN baseline).
    """

    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason

    groups: int
    epsilon: float = 1e-5
    use_scale: bool = True
    use_bias: bool = True

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        opts = dict(opts)
        opts["groups"] = resolve_groups(ctx.norm, "groups", opts.get("groups"), ctx.dim,
                                        ctx.num_heads)
        return cls(name=name, **opts)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        b, t, c = x.shape
        xg = x.astype(jnp.float32).reshape(b, t, self.groups, c // self.groups)
        mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True)
        y = ((xg - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(b, t, c)
        return _affine(self, y, self.use_scale, self.use_bias).astype(x.dtype)


class InstanceNorm(nn.Module):
    """Per sample and channel, statistics over the T tokens.

    ``unbiased=True`` divides the variance by T-1 as the DTN repository's IN baseline does
    (torch/Flax InstanceNorm: biased, the default here).
    """

    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason

    epsilon: float = 1e-5
    unbiased: bool = False
    use_scale: bool = True
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        t = x.shape[1]
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=1, keepdims=True)
        ss = jnp.sum(jnp.square(x32 - mean), axis=1, keepdims=True)
        var = ss / (t - 1 if self.unbiased and t > 1 else t)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return _affine(self, y, self.use_scale, self.use_bias).astype(x.dtype)

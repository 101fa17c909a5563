"""The seed's dynamic learnable feature normalization (seeds/000): per-token feature scaling.

Seed 000 writes two feature scalings of a token over its C channels and asks for a learnable,
dynamic version that reorganises away at inference:

    zscore:  scale * (x - mean_C) / sqrt(var_C,unbiased + eps) + bias     (sigma with N - 1)
    minmax:  scale * (x - min_C) / (max_C - min_C + eps) + bias

Each trains with the token's own statistics (dynamic) and a learnable per-channel affine. The affine
folds into the next Dense (``split_affine``); the statistics stay. Used as ``N1`` of the
``progressive`` norm with a foldable ``N2`` (RepBN, BN, LearnableScaler), the whole norm becomes a
fixed affine that folds away (docs/norms.md, "Dynamic feature normalization").
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import channel_affine, channel_params, NormContext
from normvit_jax.norms.layernorm import standardise


class _FeatureNorm(nn.Module):
    TOKEN_DDOF = None  # a per-token standardiser's ddof (ZScore: 1)
    SPLIT_KEEPS = "the per-token statistics"  # what stays in the slot after reparam folds the affine

    epsilon: float = 1e-6
    affine: bool = True

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        if ctx.dim < 2:
            raise ValueError(f"norm {ctx.norm!r} needs at least 2 channels (got {ctx.dim})")
        return cls(name=name, **opts)

    def split_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c, kept options, kept params): output = a * f(x) + c, f the norm without affine."""
        if not self.affine:
            return None
        return jnp.asarray(params["scale"]), jnp.asarray(params["bias"]), {"affine": False}, {}

    def scaled(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        if self.TOKEN_DDOF is not None and train and jnp.dtype(x.dtype).itemsize < 4:
            # half-precision training: LayerNorm's written-out backward with this ddof, which
            # keeps the input and two numbers a token (autodiff kept float32 copies: S/16 step
            # 1.12x LayerNorm's memory-bound bytes, docs/benchmarks.md)
            scale, bias = channel_params(self, x.shape[-1], self.affine, self.affine)
            return standardise(x, scale, bias, self.epsilon, self.TOKEN_DDOF)
        y = self.scaled(x.astype(jnp.float32))
        return (channel_affine(self, y) if self.affine else y).astype(x.dtype)


class ZScore(_FeatureNorm):
    """Per-token z-score over channels with the unbiased (N - 1) standard deviation (the seed's
    formula; LayerNorm uses the biased one)."""

    TOKEN_DDOF = 1  # a per-token standardiser: the progressive norm's one-pass hand-over takes it

    def scaled(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True, ddof=1)
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon)


class MinMax(_FeatureNorm):
    """Per-token min-max scaling over channels to [0, 1]; the affine recentres it."""

    def scaled(self, x: jax.Array) -> jax.Array:
        lo = jnp.min(x, axis=-1, keepdims=True)
        hi = jnp.max(x, axis=-1, keepdims=True)
        return (x - lo) / (hi - lo + self.epsilon)

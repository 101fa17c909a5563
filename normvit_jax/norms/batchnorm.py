"""BatchNorm on tokens: per channel over all B*T tokens, running mean/var in ``batch_stats``."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms import token_channel
from normvit_jax.norms._common import (NormContext, as_groups, check_group_size,
                                       ghost_groups, updating)


class BatchNorm(nn.Module):
    """Normalises with the biased batch variance; eval uses the running statistics.

    momentum 0.9 is Flax's convention (PyTorch's 0.1). ``unbiased_running_var`` stores n/(n-1)
    times the batch variance as torch's BatchNorm1d (the DTN repository). ``stats_group_size``:
    ghost batches of that many samples, each normalised with its own statistics (the per-GPU
    statistics of the references); the running statistics then average the groups' statistics.
    With None, under a sharded jit the mean over the batch axis is global (synchronised BN).
    """

    TAKES_TOKEN_MIX = True  # __call__(..., token_mix=): the progressive hand-over in one pass

    momentum: float = 0.9
    epsilon: float = 1e-5
    unbiased_running_var: bool = False
    stats_group_size: int | None = None
    use_scale: bool = True
    use_bias: bool = True

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        check_group_size(ctx.norm, opts.get("stats_group_size"))
        return cls(name=name, **opts)

    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c) with eval output a * x + c per channel (normvit_jax.reparam folds it)."""
        a = jax.lax.rsqrt(jnp.asarray(stats["var"]) + self.epsilon)
        if self.use_scale:
            a = a * params["scale"]
        c = -jnp.asarray(stats["mean"]) * a
        if self.use_bias:
            c = c + params["bias"]
        return a, c

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False,
                 plus_identity: jax.Array | float = 0.0,
                 token_mix: token_channel.TokenMix | None = None) -> jax.Array:
        """BN(x) + plus_identity * x (RepBN's eta; 0 for BN), computed as one per-channel affine
        ``a * x + c`` in float32 from both moments taken in one pass: forward and backward each
        read the activation once for the statistics and once for the affine.

        ``token_mix`` (training only; the progressive norm's hand-over): the output is
        ``w * N1(x) + (1 - w) * (BN(x) + plus_identity * x)`` with N1 a per-token standardiser,
        in one pass (norms/token_channel.py)."""
        b, t, c = x.shape
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (c,), jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, (c,), jnp.float32)
        scale = (self.param("scale", nn.initializers.ones, (c,), jnp.float32)
                 if self.use_scale else 1.0)
        bias = (self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
                if self.use_bias else 0.0)
        if not train:
            a = jax.lax.rsqrt(ra_var.value + self.epsilon) * scale
            y = x.astype(jnp.float32) * (a + plus_identity) + (bias - ra_mean.value * a)
            return y.astype(x.dtype)
        if token_mix is not None:
            g = ghost_groups(b, self.stats_group_size, "batchnorm")
            per_c = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.float32), (c,))
            y, st = token_channel.mix(
                x, jax.lax.stop_gradient(ra_mean.value), token_mix.weight, *token_mix.affine(c),
                per_c(scale), per_c(bias), jnp.asarray(plus_identity, jnp.float32), groups=g,
                eps1=token_mix.epsilon, ddof=token_mix.ddof, eps2=self.epsilon)
            self._update_running(ra_mean, ra_var, st.mean, st.var, b // g * t, train)
            return y
        xg = as_groups(x, self.stats_group_size, "batchnorm")  # (G, B/G, T, C)
        # One pass for both moments (sibling reductions of the same input), shifted by the
        # running mean so that E[d^2] - E[d]^2 does not cancel when |mean| >> std; the shift
        # is a constant (no gradient), so the statistics and their gradients are unchanged.
        shift = jax.lax.stop_gradient(ra_mean.value)
        d = xg - shift
        m1 = jnp.mean(d, axis=(1, 2), keepdims=True)
        var = jnp.maximum(jnp.mean(jnp.square(d), axis=(1, 2), keepdims=True) - jnp.square(m1), 0.0)
        mean = m1 + shift
        a = jax.lax.rsqrt(var + self.epsilon) * scale
        y = (xg * (a + plus_identity) + (bias - mean * a)).reshape(b, t, c)
        self._update_running(ra_mean, ra_var, mean, var, xg.shape[1] * t, train)
        return y.astype(x.dtype)

    def _update_running(self, ra_mean: Any, ra_var: Any, mean: jax.Array, var: jax.Array, n: int,
                        train: bool) -> None:
        """Running averages of the groups' batch statistics ((G, 1, 1, C) each, n values each)."""
        if not updating(self, train):
            return
        store_var = jnp.mean(var, axis=(0, 1, 2))
        if self.unbiased_running_var:
            store_var = store_var * (n / max(n - 1, 1))
        m = self.momentum
        ra_mean.value = m * ra_mean.value + (1 - m) * jax.lax.stop_gradient(
            jnp.mean(mean, axis=(0, 1, 2)))
        ra_var.value = m * ra_var.value + (1 - m) * jax.lax.stop_gradient(store_var)

"""PowerNorm (Shen et al., ICML 2020): group scaling, then a quadratic-mean "batch norm" without
centring whose backward is approximated with a running statistic (ema_gz) instead of the exact
batch-statistic term. ema_gz is updated by the custom backward and returned as the cotangent of
its own input (the increment): see ``normvit_jax.norms.gradient_rule``.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import (NormContext, as_groups, check_group_size,
                                       group_rms_scale, resolve_groups, updating)

BACKWARDS = ("reference", "dtn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def power_core(x: jax.Array, gamma: jax.Array, beta: jax.Array, ema_gz: jax.Array,
               inv_fwd: jax.Array, inv_bwd: jax.Array, alpha_bkw: float) -> jax.Array:
    """y = gamma * x * inv_fwd + beta on grouped tokens x (G, B/G, T, C); inv_* broadcast
    (G|1, 1, 1, C)."""
    return gamma * (x * inv_fwd) + beta


def _power_fwd(x, gamma, beta, ema_gz, inv_fwd, inv_bwd, alpha_bkw):
    z = x * inv_fwd
    return gamma * z + beta, (z, gamma, ema_gz, inv_fwd, inv_bwd)


def _power_bwd(alpha_bkw, res, dy):
    z, gamma, ema_gz, inv_fwd, inv_bwd = res
    g_hat = dy * gamma - (1.0 - alpha_bkw) * ema_gz * z
    # ema_gz is an accumulating sum (not an EMA) of mean(g_hat * z) over all tokens.
    increment = jnp.mean(g_hat * z, axis=(0, 1, 2))
    dx = g_hat * inv_bwd  # the dependence of the statistic on x is what ema_gz approximates
    return (dx, jnp.sum(dy * z, axis=(0, 1, 2)), jnp.sum(dy, axis=(0, 1, 2)), increment,
            jnp.zeros_like(inv_fwd), jnp.zeros_like(inv_bwd))


power_core.defvjp(_power_fwd, _power_bwd)


class PowerNorm(nn.Module):
    """State (batch_stats): running_phi (init 1), ema_gz (init 0, backward-updated), t (step).

    warmup: steps t <= warmup normalise with the batch quadratic mean psi2, later ones with
    running_phi. groups: the group scaling's channel groups (reference: 1; the DTN repository:
    'heads'). backward 'reference' divides by sqrt(psi2 + eps) always; 'dtn' (the DTN repository's
    copy) by the freshly updated running_phi once t >= warmup.
    """

    # reparam's reason for keeping the slot
    NOT_FOLDED = "its group scaling divides each token by its own RMS at inference"

    groups: int = 1
    warmup: int = 10000
    alpha_fwd: float = 0.9
    alpha_bkw: float = 0.9
    epsilon: float = 1e-5
    group_epsilon: float = 1e-5
    backward: str = "reference"
    stats_group_size: int | None = None

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        opts = dict(opts)
        opts["groups"] = resolve_groups(ctx.norm, "groups", opts.get("groups", 1), ctx.dim,
                                        ctx.num_heads)
        if opts.get("backward", "reference") not in BACKWARDS:
            raise ValueError(f"norm {ctx.norm!r}: backward={opts['backward']!r} is not accepted; "
                             f"accepted: {list(BACKWARDS)}")
        check_group_size(ctx.norm, opts.get("stats_group_size"))
        return cls(name=name, **opts)

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        b, t_len, c = x.shape
        gamma = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        beta = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        phi = self.variable("batch_stats", "running_phi", jnp.ones, (c,), jnp.float32)
        ema_gz = self.variable("batch_stats", "ema_gz", jnp.zeros, (c,), jnp.float32)
        # float32 step counter (exact to 2^24 steps): jax.grad over batch_stats needs no allow_int.
        step = self.variable("batch_stats", "t", jnp.zeros, (), jnp.float32)
        # Group scaling in training and inference, differentiated by ordinary autodiff.
        xs = group_rms_scale(x.astype(jnp.float32), self.groups, self.group_epsilon)
        if not train:
            return (gamma * xs * jax.lax.rsqrt(phi.value + self.epsilon) + beta).astype(x.dtype)
        xg = as_groups(xs, self.stats_group_size, "powernorm")  # (G, B/G, T, C)
        psi2 = jax.lax.stop_gradient(jnp.mean(jnp.square(xg), axis=(1, 2), keepdims=True))
        psi2_all = jnp.mean(psi2, axis=(0, 1, 2))
        t = jax.lax.stop_gradient(step.value) + 1  # 1-based, as the reference's incremented iters
        phi_old = jax.lax.stop_gradient(phi.value)
        inv_batch = jax.lax.rsqrt(psi2 + self.epsilon)
        inv_fwd = jnp.where(t <= self.warmup, inv_batch, jax.lax.rsqrt(phi_old + self.epsilon))
        # Cumulative average strictly before warmup ends, then the EMA at every step. Each ghost
        # group's own update (a GPU's, which its 'dtn' backward reads); the state keeps the mean.
        phi_group = jnp.where(t < self.warmup, phi_old * (t - 1) / t + psi2 / t, phi_old)
        phi_group = self.alpha_fwd * phi_group + (1 - self.alpha_fwd) * psi2  # (G, 1, 1, C)
        phi_new = jnp.mean(phi_group, axis=(0, 1, 2))
        if self.backward == "dtn":
            inv_bwd = jnp.where(t >= self.warmup, jax.lax.rsqrt(phi_group + self.epsilon), inv_batch)
        else:
            inv_bwd = inv_batch
        y = power_core(xg, gamma, beta, ema_gz.value, inv_fwd, inv_bwd, self.alpha_bkw)
        if updating(self, train):
            step.value = t
            phi.value = phi_new
        return y.reshape(b, t_len, c).astype(x.dtype)

"""Unified Normalization, UN (Yang et al., ACM MM 2022): a BatchNorm-like norm without centring
whose statistics are smoothed over a window of steps (geometric mean), with outlier filtration and
a custom backward smoothed the same way. Every piece of state lives in ``batch_stats``; the gz
window and ema_gz are updated by the custom backward and returned as the cotangent (increment) of
their own inputs (see ``normvit_jax.norms.gradient_rule``).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import (NormContext, as_groups, check_group_size,
                                       updating)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def un_core(x: jax.Array, gamma: jax.Array, beta: jax.Array, ema_gz: jax.Array,
            buffer_gz: jax.Array, inv: jax.Array, r: jax.Array, t: jax.Array, skip: jax.Array,
            window_bp: int, warmup: int, momentum: float) -> jax.Array:
    """y = gamma * x * inv + beta on grouped tokens x (G, B/G, T, C). r only shapes the backward."""
    return gamma * (x * inv) + beta


def _un_fwd(x, gamma, beta, ema_gz, buffer_gz, inv, r, t, skip, window_bp, warmup, momentum):
    z = x * inv
    return gamma * z + beta, (z, gamma, ema_gz, buffer_gz, inv, r, t, skip)


def _un_bwd(window_bp, warmup, momentum, res, dy):
    z, gamma, ema_gz, buffer_gz, inv, r, t, skip = res  # skip: (G, 1, 1, 1), one per ghost group
    g = dy * gamma * r
    gz = jnp.mean(g * z, axis=(1, 2), keepdims=True)  # (G, 1, 1, C)
    # Each ghost group as one GPU: its own value in this step's slot of the window (on a skip the
    # OLD ema_gz, not this step's gz), its own window mean and fresh ema_gz; the state keeps the
    # mean over the groups.
    own = jnp.where(skip, ema_gz, gz)[:, 0, 0]  # (G, C)
    windows = jnp.broadcast_to(buffer_gz, own.shape[:1] + buffer_gz.shape)
    windows = windows.at[:, t.astype(jnp.int32) % window_bp].set(own)  # (G, W_bp, C)
    plain = (t <= window_bp) | (t < warmup) | skip
    mean_gz = jnp.where(plain, gz, jnp.mean(windows, axis=1)[:, None, None])  # (G, 1, 1, C)
    ema_group = momentum * ema_gz + (1 - momentum) * mean_gz
    new_ema = jnp.mean(ema_group, axis=(0, 1, 2))
    new_buffer = jnp.mean(windows, axis=0)
    g_hat = g - jnp.where(skip, mean_gz, ema_group) * z
    return (g_hat * inv, jnp.sum(dy * r * z, axis=(0, 1, 2)), jnp.sum(dy, axis=(0, 1, 2)),
            new_ema - ema_gz, new_buffer - buffer_gz, jnp.zeros_like(inv), jnp.zeros_like(r),
            jnp.zeros_like(t), None)


un_core.defvjp(_un_fwd, _un_bwd)


class UnifiedNorm(nn.Module):
    """State (batch_stats): running_var (init 1), buffer_x2 (W_fp, C), buffer_gz (W_bp, C),
    ema_gz (C), t (step), skips (outlier steps counted).

    window: int or (fp, bp); warmup: steps before the windowed statistics are used;
    outlier_filtration: the reference layer's default is off, its T2T-ViT turns it on.
    stats_group_size: ghost groups run as one GPU each (their own s_t / gz in this step's window
    slots, skips, window means and fresh ema_gz); the windows, running_var, ema_gz and skips
    kept are the mean over the groups.
    """

    window: tuple[int, int] = (4, 4)
    warmup: int = 4000
    epsilon: float = 1e-5
    momentum: float = 0.9
    outlier_filtration: bool = False
    stats_group_size: int | None = None
    ratio_warmup: int = 1000  # r stays 1 while t <= max(ratio_warmup, warmup); reference: 1000

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        opts = dict(opts)
        w = opts.get("window", 4)
        w = (w, w) if isinstance(w, int) else tuple(w)
        if len(w) != 2 or not all(isinstance(v, int) and v >= 1 for v in w):
            raise ValueError(f"norm {ctx.norm!r}: window={opts.get('window')!r} is not accepted; "
                             "accepted: a positive int or a pair (forward, backward) of them")
        opts["window"] = w
        check_group_size(ctx.norm, opts.get("stats_group_size"))
        return cls(name=name, **opts)

    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c) with eval output a * x + c per channel (normvit_jax.reparam folds it)."""
        a = params["scale"] * jax.lax.rsqrt(jnp.asarray(stats["running_var"]) + self.epsilon)
        return a, jnp.asarray(params["bias"])

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        b, t_len, c = x.shape
        wf, wb = self.window
        gamma = self.param("scale", nn.initializers.ones, (c,), jnp.float32)
        beta = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        running_var = self.variable("batch_stats", "running_var", jnp.ones, (c,), jnp.float32)
        buffer_x2 = self.variable("batch_stats", "buffer_x2", jnp.zeros, (wf, c), jnp.float32)
        buffer_gz = self.variable("batch_stats", "buffer_gz", jnp.zeros, (wb, c), jnp.float32)
        ema_gz = self.variable("batch_stats", "ema_gz", jnp.zeros, (c,), jnp.float32)
        # float32 counters (exact to 2^24 steps): jax.grad over batch_stats needs no allow_int.
        step = self.variable("batch_stats", "t", jnp.zeros, (), jnp.float32)
        skips = self.variable("batch_stats", "skips", jnp.zeros, (), jnp.float32)
        if not train:
            y = gamma * x.astype(jnp.float32) * jax.lax.rsqrt(running_var.value + self.epsilon)
            return (y + beta).astype(x.dtype)
        sg = jax.lax.stop_gradient
        xg = as_groups(x, self.stats_group_size, "unified")  # (G, B/G, T, C)
        s = sg(jnp.mean(jnp.square(xg), axis=(1, 2)))  # (G, C), no centring
        t = sg(step.value) + 1  # 1-based, as the reference's incremented iters
        rv = sg(running_var.value)
        buf = sg(buffer_x2.value)
        # sigma_rec: one scalar, unbiased variance of sqrt(window) over all W x C entries, taken
        # before this step's statistic enters the window.
        sigma_rec = jnp.var(jnp.sqrt(buf), ddof=1) if wf * c > 1 else jnp.zeros(())
        slot = t.astype(jnp.int32) % wf
        # Each ghost group as one GPU: the window with ITS statistic in this step's slot, its own
        # skip and geometric mean; the state keeps the mean over the groups (the references keep
        # rank 0's). One group: the reference layer.
        windows = jnp.broadcast_to(buf, s.shape[:1] + buf.shape).at[:, slot].set(s)  # (G, W, C)
        skip = jnp.full(s.shape[:1], wf == 1)  # a window of 1: every step counts as a skip
        outlier = jnp.zeros(s.shape[:1], bool)
        if self.outlier_filtration:
            am = jnp.mean(windows, axis=1)
            gm = jnp.exp(jnp.mean(jnp.log(windows), axis=1))
            outlier = (t >= self.warmup) & jnp.any(am - gm > sigma_rec * wf, axis=-1)  # (G,)
            windows = jnp.where(outlier[:, None, None], windows.at[:, slot].set(rv), windows)
            skip = skip | outlier
        gm = jnp.exp(jnp.mean(jnp.log(windows), axis=1))  # geometric mean of each window
        skip_c = skip[:, None]
        var = jnp.where((t <= wf) | (t < self.warmup) | skip_c, s, gm)  # (G, C)
        r = jnp.sqrt(var + self.epsilon) / jnp.sqrt(rv + self.epsilon)
        r = jnp.where((t <= max(self.ratio_warmup, self.warmup)) | skip_c, 1.0,
                      jnp.clip(r, 0.2, 5.0))
        per_group = lambda a: a[:, None, None]  # (G, C) -> (G, 1, 1, C)
        y = un_core(xg, gamma, beta, ema_gz.value, buffer_gz.value,
                    per_group(jax.lax.rsqrt(var + self.epsilon)), per_group(r), t,
                    skip[:, None, None, None], wb, self.warmup, self.momentum)
        if updating(self, train):
            step.value = t
            buffer_x2.value = jnp.mean(windows, axis=0)
            running_var.value = (self.momentum * rv
                                 + (1 - self.momentum) * jnp.mean(var, axis=0))
            # With ghost groups a skip counts as the fraction of the groups that skipped.
            skips.value = sg(skips.value) + jnp.mean(outlier.astype(jnp.float32))
        return y.reshape(b, t_len, c).astype(x.dtype)

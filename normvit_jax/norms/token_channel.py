"""The progressive hand-over of a per-token standardiser to BatchNorm/RepBN, in one pass.

    y = w * (g1 * (x - mu_t) * r_t + b1) + (1 - w) * (g2 * (x - mu_c) * r_c + b2 + eta * x)

mu_t, r_t: the token's mean and 1/sqrt(var + eps1) over its C channels (LayerNorm: biased variance,
z-score: unbiased); mu_c, r_c: the channel's batch mean and 1/sqrt(var + eps2) over the samples
and tokens of its ghost group (BatchNorm; RepBN adds eta * x). Computed plainly, the two norms
read the activation separately, keep their own float32 intermediates for the backward and take
their gradients in separate passes. Here the output is one per-element affine
``x * A + B`` (A, B from per-token and per-channel vectors), the backward is written out
(custom_vjp) from the column sums (dy, dy * x, dy * xhat_t) and the row sums (u, u * xhat_t),
u = dy * g1, and only the input and the small statistics are kept.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenMix(NamedTuple):
    """N1 of the hand-over, a per-token standardiser (LayerNorm: ddof 0; z-score: ddof 1), and its
    weight w. scale/bias: its (C,) float32 parameters, None where it has none."""

    weight: jax.Array
    scale: jax.Array | None
    bias: jax.Array | None
    epsilon: float
    ddof: int

    def affine(self, c: int) -> tuple[jax.Array, jax.Array]:
        one, zero = jnp.ones((c,), jnp.float32), jnp.zeros((c,), jnp.float32)
        return (one if self.scale is None else self.scale,
                zero if self.bias is None else self.bias)


class Stats(NamedTuple):
    """Batch statistics per group, (G, 1, 1, C) float32: for the running averages."""

    mean: jax.Array
    var: jax.Array


def _forward(xg, shift, w, g1, b1, g2, b2, eta, eps1, ddof, eps2):
    c = xg.shape[-1]
    mu_t = jnp.mean(xg, axis=-1, keepdims=True)
    var_t = jnp.sum(jnp.square(xg - mu_t), axis=-1, keepdims=True) / (c - ddof)
    r_t = jax.lax.rsqrt(var_t + eps1)
    # Both channel moments in one pass, shifted by the running mean (BatchNorm's rule: no
    # cancellation once the running mean follows the data).
    d = xg - shift
    m1 = jnp.mean(d, axis=(1, 2), keepdims=True)
    var_c = jnp.maximum(jnp.mean(jnp.square(d), axis=(1, 2), keepdims=True) - jnp.square(m1), 0.0)
    mu_c = m1 + shift
    r_c = jax.lax.rsqrt(var_c + eps2)
    a_c = g2 * r_c
    scale = w * g1 * r_t + (1.0 - w) * (a_c + eta)
    offset = w * (b1 - g1 * mu_t * r_t) + (1.0 - w) * (b2 - mu_c * a_c)
    return xg * scale + offset, (mu_t, r_t, mu_c, var_c, r_c)


def mix(x: jax.Array, shift: jax.Array, w: jax.Array, g1: jax.Array, b1: jax.Array,
        g2: jax.Array, b2: jax.Array, eta: jax.Array, *, groups: int, eps1: float, ddof: int,
        eps2: float) -> tuple[jax.Array, Stats]:
    """x (B, T, C) in any float dtype -> (y in x's dtype, batch Stats of ``groups`` ghost groups
    of B/groups samples). ``shift``: the running mean (no gradient); w: N1's weight (no
    gradient); g1, b1, g2, b2: (C,) float32; eta: () float32. Statistics in float32."""
    b, t, c = x.shape
    xg = x.reshape(groups, b // groups, t, c)  # samples and tokens stay two axes (as_groups)
    y, stats = _mixer(eps1, ddof, eps2)(xg, shift, w, g1, b1, g2, b2, eta)
    return y.reshape(b, t, c), stats


@functools.lru_cache(maxsize=None)
def _mixer(eps1: float, ddof: int, eps2: float):
    """The custom_vjp function with the static settings closed over."""

    @jax.custom_vjp
    def f(xq, shift, w, g1, b1, g2, b2, eta):
        return fwd(xq, shift, w, g1, b1, g2, b2, eta)[0]

    def fwd(xq, shift, w, g1, b1, g2, b2, eta):
        xg = xq.astype(jnp.float32)
        y, (mu_t, r_t, mu_c, var_c, r_c) = _forward(xg, shift, w, g1, b1, g2, b2, eta, eps1, ddof,
                                                    eps2)
        # kept for the backward: the input in its own dtype and per-token/per-channel vectors
        return (y.astype(xq.dtype), Stats(mu_c, var_c)), (xq, shift, w, g1, g2, eta, mu_t, r_t,
                                                          mu_c, r_c)

    def bwd(res, cts):
        xq, shift, w, g1, g2, eta, mu_t, r_t, mu_c, r_c = res
        xg = xq.astype(jnp.float32)
        dy = cts[0].astype(jnp.float32)  # the statistics are outputs without gradient
        c = xg.shape[-1]
        n = xg.shape[1] * xg.shape[2]  # samples x tokens per group
        xhat_t = (xg - mu_t) * r_t
        # column sums per group (G, 1, 1, C); dy * (x - shift) keeps dy * xhat_c free of the
        # cancellation a large channel mean would cause
        s_dy = jnp.sum(dy, axis=(1, 2), keepdims=True)
        s_dyx = jnp.sum(dy * (xg - shift), axis=(1, 2), keepdims=True)
        s_dyxt = jnp.sum(dy * xhat_t, axis=(1, 2), keepdims=True)
        s_dyxc = r_c * (s_dyx - (mu_c - shift) * s_dy)  # sum dy * xhat_c
        # row sums per token (G, n, T, 1) of u = w * g1 * dy
        u = w * g1 * dy
        r_u = jnp.mean(u, axis=-1, keepdims=True)
        r_uxt = jnp.sum(u * xhat_t, axis=-1, keepdims=True) / (c - ddof)
        dx_t = r_t * (u - r_u) - r_t * xhat_t * r_uxt
        v_mean = (1.0 - w) * g2 * s_dy / n
        vx_mean = (1.0 - w) * g2 * s_dyxc / n
        dx_c = r_c * ((1.0 - w) * g2 * dy - v_mean - (xg - mu_c) * r_c * vx_mean)
        dx = dx_t + dx_c + (1.0 - w) * eta * dy
        per_c = lambda s: jnp.sum(s, axis=(0, 1, 2))
        dg1 = w * per_c(s_dyxt)
        db1 = w * per_c(s_dy)
        dg2 = (1.0 - w) * per_c(s_dyxc)
        db2 = (1.0 - w) * per_c(s_dy)
        deta = (1.0 - w) * jnp.sum(s_dyx + shift * s_dy)
        return (dx.astype(xq.dtype), jnp.zeros_like(shift), jnp.zeros_like(w), dg1, db1, dg2, db2,
                deta)

    f.defvjp(fwd, bwd)
    return f

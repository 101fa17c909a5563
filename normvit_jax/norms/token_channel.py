"""The progressive hand-over of a per-token standardiser to BatchNorm/RepBN, in one pass.

    y = w * (g1 * (x - mu_t) * r_t + b1) + (1 - w) * (g2 * (x - mu_c) * r_c + b2 + eta * x)

mu_t, r_t: the token's mean and 1/sqrt(var + eps1) over its C channels (LayerNorm: biased variance,
z-score: unbiased); mu_c, r_c: the channel's batch mean and 1/sqrt(var + eps2) over the samples
and tokens of its ghost group (BatchNorm; RepBN adds eta * x). Computed plainly, the two norms
read the activation separately, keep their own float32 intermediates for the backward and take
their gradients in separate passes. Here the output is one per-element affine
``x * A + B`` (A, B from per-token and per-channel vectors), the backward is written out
(custom_vjp) from the column sums (dy, dy * x, dy * xhat_t) and the row sums (u, u * xhat_t),
u = dy * g1, and only the input and the small statistics are kept. Every sum and dx are written
as functions of dy, x and small vectors only (no shared full-size product such as u or xhat_t):
XLA:GPU then reads the activation in each reduction instead of storing float32 products of it
(``python -m benchmarks.gpu_hlo``, S/16, stream layout left to XLA: a hand-over slot's backward
went from 12-13 kernels and 855-893 MB to 10 kernels and 584-623 MB; LayerNorm's: 7 kernels,
389-525 MB; docs/benchmarks.md).
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
        xs = xq.astype(jnp.float32) - shift  # shifted by the running mean: no cancellation below
        dy = cts[0].astype(jnp.float32)  # the statistics are outputs without gradient
        c = xs.shape[-1]
        n = xs.shape[1] * xs.shape[2]  # samples x tokens per group
        m_t = mu_t - shift  # (G, n, T, C): the token mean in the shifted frame, per channel
        # Every sum below reads only dy, the shifted input and small vectors, so each reduction
        # can read the activation itself instead of a stored float32 product of it.
        col = lambda a: jnp.sum(a, axis=(1, 2), keepdims=True)  # noqa: E731
        s_dy = col(dy)
        s_dyx = col(dy * xs)
        s_dyxt = col(dy * r_t * (xs - m_t))  # sum dy * xhat_t
        s_dyxc = r_c * (s_dyx - (mu_c - shift) * s_dy)  # sum dy * xhat_c
        # row sums per token of u = w * g1 * dy: sum u and sum u * xhat_t
        gdy = g1 * dy
        r_u = w * jnp.mean(gdy, axis=-1, keepdims=True)
        r_uxt = w * r_t * jnp.sum(gdy * (xs - m_t), axis=-1, keepdims=True) / (c - ddof)
        v_mean = (1.0 - w) * g2 * s_dy / n
        vx_mean = (1.0 - w) * g2 * s_dyxc / n
        # dx: dy times a per-token-and-channel factor, minus the two centred inputs times theirs,
        # minus a per-token-and-channel constant; x - mu_t and x - mu_c taken as differences
        # (not expanded), so no term cancels against another when the means are large.
        a = w * g1 * r_t + (1.0 - w) * (g2 * r_c + eta)
        dx = (dy * a - (r_t * r_t * r_uxt) * (xs - m_t)
              - (r_c * r_c * vx_mean) * (xs - (mu_c - shift)) - (r_t * r_u + r_c * v_mean))
        per_c = lambda s: jnp.sum(s, axis=(0, 1, 2))  # noqa: E731
        dg1 = w * per_c(s_dyxt)
        db1 = w * per_c(s_dy)
        dg2 = (1.0 - w) * per_c(s_dyxc)
        db2 = (1.0 - w) * per_c(s_dy)
        deta = (1.0 - w) * jnp.sum(s_dyx + shift * s_dy)
        return (dx.astype(xq.dtype), jnp.zeros_like(shift), jnp.zeros_like(w), dg1, db1, dg2, db2,
                deta)

    f.defvjp(fwd, bwd)
    return f

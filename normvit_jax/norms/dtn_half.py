"""DTN on the half-precision path (moments on a GPU's or TPU's matrix units), forward and backward
written out: the same function as norms/dtn.py's ``_dtn`` (tested equal), for the case it serves on
accelerators, a grid without pooling.

Autodiff of ``_dtn`` under ``jax.checkpoint`` gave XLA:GPU a backward of 42 kernels and 5.3 GB of
traffic a B/16 slot (LayerNorm's: 6 and 0.85 GB): float32 copies of the scaled input, of both
statistics and of their cotangents, each written and read back. Here the backward keeps the input
and the two (B, 1, C) token shifts, recomputes the moments (one half-precision matmul), writes the
three per-element cotangents it needs once, in the half dtype, and is otherwise a few passes over
(x, moments, cotangents): the per-token sums, the moments' cotangent and its two matmuls, the
parameters' sums over the tokens, dx. 18 kernels and 2.9 GB a slot (``benchmarks.gpu_hlo``). What
keeps XLA's fusions whole:
- P is padded with zero rows and columns for the prefix (class) tokens, so the moments, the
  matmul operands and their cotangents cover all T tokens: no slice or concatenation of the
  token axis, which XLA materialises; a prefix token gets zero IN moments and LN's statistics
  through gates set to 1 (its row of P is zero, so it adds nothing to the patches' moments);
- the backward starts behind ``lax.optimization_barrier`` on its inputs and the cotangent, so that
  XLA neither merges the recomputation with the forward (CSE) nor schedules it into the forward
  (where it had fused it into the forward's last kernel); either kept float32 intermediates alive
  from the forward to the backward;
- the per-element cotangents (g scale r, the variance's, g yhat) are rounded to the half dtype,
  g's own: each is g times float32 factors, rounded as g itself was (docs/norms.md gives the
  errors against float64: no worse than autodiff's);
- the sums that share a pass are one variadic reduce (one kernel, one read of its inputs), two
  sums at most: of four, XLA wrote the summands out in float32 first (3.8 against 2.9 GB a slot).

With xs = x * rs (rs the per-head RMS pre-scaling), mu = lm mu_LN + (1 - lm) mu_IN and
var = lv var_LN + (1 - lv) var_IN (per channel), r = (var + eps)^-1/2, yhat = (xs - mu) r and the
cotangent g of y = yhat * scale + bias:

    dyhat = g scale;  direct = dyhat r;  dmu = -direct;  dvar = -dyhat yhat r^2 / 2
    LN:  dmu_LN = sum_c lm dmu,  dvar_LN = sum_c lv dvar,  var_LN = k (E[xs^2] - mu_LN^2), k = C/(C-1)
         dxs = direct + (dmu_LN - 2 mu_LN k dvar_LN) / C + 2 xs k dvar_LN / C
    IN:  d mu' = (1 - lm) dmu - 2 mu' (1 - lv) dvar,  d m2' = (1 - lv) dvar  (mu', m2': moments of
         the shifted tokens ph and their squares); [d ph, d sq], dP: the matmul's own vjp;
         dxs += d ph + 2 ph d sq
    RMS: dx = rs (dxs - xs mean_d(dxs xs))  per head

A clamp (a variance below zero by rounding, set to zero) passes no gradient, as autodiff of the
``maximum`` in the forward does.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from normvit_jax.norms import dtn_moments
from normvit_jax.norms._common import variadic_sums

_F32 = jnp.float32


class _Tokens(NamedTuple):
    """Per-token statistics, the shifts, and the moments' matmul with its operands."""

    rs: jax.Array        # (b, t, h, 1) RMS pre-scaling
    mu_ln: jax.Array     # (b, t, 1)
    var_raw: jax.Array   # (b, t, 1) E[xs^2] - mu_LN^2 before the clamp
    var_ln: jax.Array    # (b, t, 1)
    shift: jax.Array     # (b, 1, c) the patch tokens' mean
    sq_shift: jax.Array  # (b, 1, c) their squares' centring constant
    tokens: jax.Array    # (b, t, h, 2d) the matmul operand, half dtype
    p: jax.Array         # (h, t, t) P padded for the prefix tokens
    moments: jax.Array   # (b, t, h, 2d) half dtype


class _Local(NamedTuple):
    """Per-element values, (b, t, c) unless said."""

    xs: jax.Array
    ph: jax.Array          # (b, t, h, d) shifted tokens
    mu_c: jax.Array        # (b, t, h, d) moments of the shifted tokens
    var_in_raw: jax.Array  # (b, t, h, d) before the clamp
    var_in: jax.Array
    mu_in: jax.Array
    lm: jax.Array          # (t, c) gates, 1 on the prefix tokens
    lv: jax.Array
    r: jax.Array
    yhat: jax.Array


def _token_stats(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any,
                 shifts: tuple[jax.Array, jax.Array] | None) -> _Tokens:
    b, t, c = x.shape
    h, pre = cfg.heads, cfg.pre
    d = c // h
    xh = x.astype(_F32).reshape(b, t, h, d)
    s1, s2 = jnp.sum(xh, -1, keepdims=True), jnp.sum(jnp.square(xh), -1, keepdims=True)
    rs = jax.lax.rsqrt(s2 / d + cfg.epsilon)
    mu_ln = jnp.sum(rs * s1, axis=2) / c
    var_raw = jnp.sum(rs * rs * s2, axis=2) / c - jnp.square(mu_ln)
    var_ln = jnp.maximum(var_raw, 0.0) * (c / (c - 1) if cfg.ln_unbiased else 1.0)
    xs = (xh * rs).reshape(b, t, c)
    if shifts is None:  # the patch tokens' mean and their squares' centring constant (dtn.py)
        patches = xs[:, pre:]
        shift = jnp.mean(patches, axis=1, keepdims=True)
        sq_shift = jnp.maximum(jnp.mean(jnp.square(patches), axis=1, keepdims=True)
                               - jnp.square(shift), 0.0)
    else:
        shift, sq_shift = shifts
    p = jnp.pad(dtn_moments.position_weights(params["pos_proj"], cfg.side),
                ((0, 0), (pre, 0), (pre, 0)))
    ph = xs.reshape(b, t, h, d) - shift.reshape(b, 1, h, d)
    tokens = jnp.concatenate([ph, jnp.square(ph) - sq_shift.reshape(b, 1, h, d)], -1)
    tokens = tokens.astype(cfg.moments_dtype)
    return _Tokens(rs, mu_ln, var_raw, var_ln, shift, sq_shift, tokens, p,
                   dtn_moments.half_moments(tokens, p))


def _local(x: jax.Array, ts: _Tokens, params: Mapping[str, jax.Array], cfg: Any) -> _Local:
    b, t, c = x.shape
    h, pre = cfg.heads, cfg.pre
    d = c // h
    xs = (x.astype(_F32).reshape(b, t, h, d) * ts.rs).reshape(b, t, c)
    shift_h, sq_shift_h = ts.shift.reshape(b, 1, h, d), ts.sq_shift.reshape(b, 1, h, d)
    ph = xs.reshape(b, t, h, d) - shift_h
    moments = ts.moments.astype(_F32)
    mu_c, m2_c = moments[..., :d], moments[..., d:]
    var_in_raw = m2_c + sq_shift_h - jnp.square(mu_c)
    var_in = jnp.maximum(var_in_raw, 0.0).reshape(b, t, c)
    mu_in = (mu_c + shift_h).reshape(b, t, c)
    patch = (jnp.arange(t) >= pre)[:, None]
    gate = lambda name: jnp.where(  # noqa: E731
        patch, jnp.repeat(jax.nn.sigmoid(params[name]), d), 1.0)
    lv = gate("var_gate")
    lm = gate("mean_gate") if cfg.mix_mean else jnp.ones((t, c), _F32)
    r = jax.lax.rsqrt(lv * ts.var_ln + (1 - lv) * var_in + cfg.epsilon)
    yhat = (xs - (lm * ts.mu_ln + (1 - lm) * mu_in)) * r
    return _Local(xs, ph, mu_c, var_in_raw, var_in, mu_in, lm, lv, r, yhat)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dtn(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any) -> jax.Array:
    """DTN of ``x`` (B, T, C); ``cfg`` is norms/dtn.py's ``_Static`` (half moments, no pooling)."""
    return _dtn_fwd(x, params, cfg)[0]


def _dtn_fwd(x, params, cfg):
    ts = _token_stats(x, params, cfg, None)
    f = _local(x, ts, params, cfg)
    y = (f.yhat * params["scale"] + params["bias"]).astype(x.dtype)
    return y, (x, params, ts.shift, ts.sq_shift)


def _dtn_bwd(cfg, res, g):
    x, params, shift, sq_shift = res
    # behind a barrier with the cotangent: the recomputation below can neither be merged with
    # the forward (CSE) nor scheduled into it, where XLA had fused it with the forward's last
    # kernel and kept its float32 results alive until here (module docstring)
    x, shift, sq_shift, g = jax.lax.optimization_barrier((x, shift, sq_shift, g))
    ts = _token_stats(x, params, cfg, (shift, sq_shift))
    b, t, c = x.shape
    h, pre = cfg.heads, cfg.pre
    d = c // h
    kappa = c / (c - 1) if cfg.ln_unbiased else 1.0

    # pass 1: the per-element cotangents, written once in the half dtype (g's own precision:
    # each is g times float32 factors, rounded as g was), and the per-token sums
    f = _local(x, ts, params, cfg)
    dyy = g.astype(_F32) * f.yhat
    dyhat = dyy * params["scale"]  # times yhat
    half = x.dtype
    direct = (g.astype(_F32) * params["scale"] * f.r).astype(half)  # d xs via xs - mu; dmu = -it
    dvar = (-0.5 * dyhat * jnp.square(f.r)).astype(half)
    dyy = dyy.astype(half)
    # written here, read by the passes below (without the barrier XLA kept float32 copies of
    # them and of r instead: 5.2 GB against 4.0 GB a B/16 slot)
    direct, dvar, dyy = jax.lax.optimization_barrier((direct, dvar, dyy))
    direct, dvar, dyy = direct.astype(_F32), dvar.astype(_F32), dyy.astype(_F32)
    dmu_ln, dvar_ln = variadic_sums((-f.lm * direct, f.lv * dvar), (2,))
    dvar_in = jnp.where(f.var_in_raw > 0, ((1 - f.lv) * dvar).reshape(b, t, h, d), 0.0)
    dmu_in = (-(1 - f.lm) * direct).reshape(b, t, h, d)
    d_moments = jnp.concatenate([dmu_in - 2 * f.mu_c * dvar_in, dvar_in], -1)
    d_tokens, dp = dtn_moments.half_moments_vjp(ts.tokens, ts.p, d_moments)
    dm2_ln = jnp.where(ts.var_raw > 0, dvar_ln[..., None] * kappa, 0.0)  # d E[xs^2]
    dmu_ln = dmu_ln[..., None] - 2 * ts.mu_ln * dm2_ln

    # pass 2: the parameters' sums over the tokens
    patch = (jnp.arange(t) >= pre)[:, None]
    dlv = jnp.where(patch, (ts.var_ln - f.var_in) * dvar, 0.0)
    dlm = jnp.where(patch, (ts.mu_ln - f.mu_in) * -direct, 0.0)
    # two reduces of two sums each: as one of four, XLA:GPU wrote its four summands out in
    # float32 and read them back (B/16: a slot's backward 3.8 -> 2.9 GB, benchmarks.gpu_hlo);
    # in pairs it sums from dyy and g as they are and fuses the gates' pair into dx's pass
    dscale, dbias = variadic_sums((dyy, g.astype(_F32)), (0, 1))
    dlv, dlm = variadic_sums((dlv, dlm), (0, 1))

    # passes 3 and 4: d xs, its per-head sum with xs, dx (the RMS pre-scaling's backward)
    d_tok = d_tokens.astype(_F32)
    d_ph = d_tok[..., :d] + 2 * f.ph * d_tok[..., d:]  # zero on the prefix tokens
    grad = (direct + dmu_ln / c + 2 * f.xs * dm2_ln / c + d_ph.reshape(b, t, c)).reshape(b, t, h, d)
    xs_h = f.xs.reshape(b, t, h, d)
    dx = ts.rs * (grad - xs_h * jnp.mean(grad * xs_h, -1, keepdims=True))

    _, p_vjp = jax.vjp(functools.partial(dtn_moments.position_weights, side=cfg.side),
                       params["pos_proj"])
    (dpos,) = p_vjp(dp[:, pre:, pre:])
    dgate = lambda lam, dlam: jnp.sum((dlam * lam * (1 - lam)).reshape(h, d), -1)  # noqa: E731
    grads = {"scale": dscale, "bias": dbias, "pos_proj": dpos, "var_gate": dgate(f.lv[-1], dlv)}
    if cfg.mix_mean:
        grads["mean_gate"] = dgate(f.lm[-1], dlm)
    return dx.reshape(b, t, c).astype(x.dtype), grads


dtn.defvjp(_dtn_fwd, _dtn_bwd)

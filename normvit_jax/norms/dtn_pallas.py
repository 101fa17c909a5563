"""DTN in Pallas kernels (Triton on a GPU), forward and backward: the same function as
norms/dtn_half.py's (tested equal), for the half-precision path without pooling (head widths that
are powers of two >= 16), selected by the option ``kernel='pallas'``; where they do not apply
(float32 evaluation or export, pooling) norms/dtn.py runs XLA's formulation.

On a GPU, XLA runs DTN as chains of kernels around the moments' batched matmul, with the
per-element intermediates (the shifted tokens and their squares, the moments, their cotangents,
float32 partial products) written out and read back between them: a B/16 slot moves ~4.7 GB a
training step (``benchmarks.gpu_hlo``; LayerNorm ~1 GB), and the layer took 4.25x LayerNorm's
time on an H200. Here one program per (sample, head) holds that head's tokens, all of them (padded
to a power of two, as Triton's blocks must be), and keeps everything between reading x (and g)
and writing its result in registers:

    RMS pre-scaling -> the patch tokens' shifts -> moments = P^T [ph, ph^2 - sq_shift]
    (two tensor-core matmuls, float32 sums) -> the mixed statistics -> y

- forward: LayerNorm's statistics, which sum over every head of a token, come from a small XLA
  reduction first (two floats a token); the kernel writes y and the two (B, 1, C) token shifts;
- backward pass 1 (``_token_sums_kernel``): recomputes the forward, writes this head's part of
  the per-token sums (d mu_LN, d var_LN: they need every head) and of the parameters' sums;
- backward pass 2 (``_dx_kernel``): recomputes, takes the per-token sums, writes dx, and writes the
  moments' operands with their cotangents in (head, token, batch, width) layout, from which XLA's
  matmul over the batch gives dP (the only sum over samples: one GEMM per head with K = B x 2d).

The backward keeps x, the shifts and LayerNorm's (B, T) statistics. The equations are
norms/dtn_half.py's (its docstring); the moments stay float32 in registers where the XLA path
rounds them to bfloat16, so the kernels are as accurate or slightly more.

Off a GPU the kernels run in Pallas's interpreter (slow: for tests, not for training).
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from normvit_jax.norms import dtn_moments

_F32 = jnp.float32


def fits(head_width: int) -> bool:
    """Whether the kernels take this head width: Triton's blocks and matmuls need a power of two,
    at least 16."""
    return head_width >= 16 and head_width & (head_width - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def ln_statistics(x: jax.Array, heads: int, epsilon: float, unbiased: bool
                  ) -> tuple[jax.Array, jax.Array]:
    """LayerNorm's mean and (clamped, optionally unbiased) variance of the RMS-pre-scaled tokens,
    (B, T) each, from the per-head sums of x and x^2 (as norms/dtn.py computes them)."""
    b, t, c = x.shape
    d = c // heads
    xh = x.astype(_F32).reshape(b, t, heads, d)
    s1, s2 = jnp.sum(xh, -1), jnp.sum(jnp.square(xh), -1)
    rs = jax.lax.rsqrt(s2 / d + epsilon)
    mu = jnp.sum(rs * s1, -1) / c
    var = jnp.maximum(jnp.sum(rs * rs * s2, -1) / c - jnp.square(mu), 0.0)
    return mu, var * (c / (c - 1) if unbiased else 1.0)


class _Inputs(NamedTuple):
    """One program's refs: sample i's tokens of head j (tp, d) and what they are normalized by."""

    x: Any        # (tp, d) tokens, rows >= t out of bounds (masked)
    mu_ln: Any    # (tp, 1) LayerNorm statistics of the RMS-scaled tokens
    var_ln: Any
    pt: Any       # (tp, tp) P^T of head j: target x source, zero for prefix and padding
    chan: Any     # (4, d) the var gate's and the mean gate's sigmoids, scale, bias


def _recompute(ins: _Inputs, *, t: int, pre: int, epsilon: float, shifts=None) -> dict[str, Any]:
    """DTN's forward for one (sample, head) in float32, what the forward and backward read."""
    tp, d = ins.x.shape
    rows = jax.lax.broadcasted_iota(jnp.int32, (tp, d), 0)
    valid = rows < t
    x = _load(ins.x, valid).astype(_F32)
    rs = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + epsilon)
    xs = x * rs
    patch = valid & (rows >= pre)
    if shifts is None:  # the patch tokens' mean and their squares' centring constant (dtn.py)
        n = t - pre
        masked = jnp.where(patch, xs, 0.0)
        shift = jnp.sum(masked, axis=0, keepdims=True) / n
        sq_shift = jnp.maximum(jnp.sum(masked * masked, axis=0, keepdims=True) / n
                               - shift * shift, 0.0)
    else:
        shift, sq_shift = shifts
    ph = jnp.where(patch, xs - shift, 0.0)
    sq = jnp.where(patch, ph * ph - sq_shift, 0.0)
    pt = ins.pt[...]
    ph, sq = ph.astype(pt.dtype), sq.astype(pt.dtype)  # the matmuls' operands, as XLA's path
    mu_c = jnp.dot(pt, ph, preferred_element_type=_F32)
    m2_c = jnp.dot(pt, sq, preferred_element_type=_F32)
    var_in_raw = m2_c + sq_shift - mu_c * mu_c
    var_in = jnp.maximum(var_in_raw, 0.0)
    mu_in = mu_c + shift
    column = jax.lax.broadcasted_iota(jnp.int32, (tp, 1), 0) < t
    mu_ln, var_ln = _load(ins.mu_ln, column), _load(ins.var_ln, column)  # (tp, 1)
    lv = jnp.where(patch, ins.chan[0:1, :], 1.0)  # a prefix token: LayerNorm's statistics
    lm = jnp.where(patch, ins.chan[1:2, :], 1.0)
    r = jax.lax.rsqrt(lv * var_ln + (1.0 - lv) * var_in + epsilon)
    yhat = (xs - (lm * mu_ln + (1.0 - lm) * mu_in)) * r
    return dict(valid=valid, patch=patch, rs=rs, xs=xs, shift=shift, sq_shift=sq_shift, ph=ph,
                sq=sq, mu_c=mu_c, var_in_raw=var_in_raw, var_in=var_in, mu_in=mu_in,
                mu_ln=mu_ln, var_ln=var_ln, lv=lv, lm=lm, r=r, yhat=yhat)


def _forward_kernel(x_ref, mu_ref, var_ref, pt_ref, chan_ref, y_ref, shift_ref, sq_shift_ref,
                    **static):
    f = _recompute(_Inputs(x_ref, mu_ref, var_ref, pt_ref, chan_ref), **static)
    y = f["yhat"] * chan_ref[2:3, :] + chan_ref[3:4, :]
    _store(y_ref, y.astype(y_ref.dtype), f["valid"])
    shift_ref[...] = f["shift"]
    sq_shift_ref[...] = f["sq_shift"]


def _cotangents(f: dict[str, Any], g_ref, chan_ref) -> tuple[Any, Any, Any]:
    """g (float32), d xs through xs - mu (``direct``; d mu = -direct) and d var, as dtn_half.py."""
    g = _load(g_ref, f["valid"]).astype(_F32)
    dyhat = g * chan_ref[2:3, :]
    return g, dyhat * f["r"], -0.5 * dyhat * f["yhat"] * f["r"] * f["r"]


def _token_sums_kernel(x_ref, mu_ref, var_ref, pt_ref, chan_ref, shift_ref, sq_shift_ref, g_ref,
                       token_ref, chan_out_ref, **static):
    """Backward pass 1: this head's part of the per-token sums over channels (d mu_LN, d var_LN)
    and of the per-channel sums over tokens (d scale, d bias, the two gates')."""
    f = _recompute(_Inputs(x_ref, mu_ref, var_ref, pt_ref, chan_ref), **static,
                   shifts=(shift_ref[...], sq_shift_ref[...]))
    g, direct, dvar = _cotangents(f, g_ref, chan_ref)
    token_ref[:, 0:1] = jnp.sum(-f["lm"] * direct, axis=1, keepdims=True)
    token_ref[:, 1:2] = jnp.sum(f["lv"] * dvar, axis=1, keepdims=True)
    patch = f["patch"]
    chan_out_ref[0:1, :] = jnp.sum(g * f["yhat"], axis=0, keepdims=True)
    chan_out_ref[1:2, :] = jnp.sum(g, axis=0, keepdims=True)
    chan_out_ref[2:3, :] = jnp.sum(jnp.where(patch, (f["var_ln"] - f["var_in"]) * dvar, 0.0),
                                   axis=0, keepdims=True)
    chan_out_ref[3:4, :] = jnp.sum(jnp.where(patch, (f["mu_ln"] - f["mu_in"]) * -direct, 0.0),
                                   axis=0, keepdims=True)


def _dx_kernel(x_ref, mu_ref, var_ref, pt_ref, chan_ref, shift_ref, sq_shift_ref, g_ref, p_ref,
               ln_ref, dx_ref, tok_mu_ref, tok_sq_ref, dm_mu_ref, dm_sq_ref, *, channels: int,
               **static):
    """Backward pass 2: d x, and the moments' matmul operands with their cotangents written for
    dP (an XLA matmul over the batch)."""
    f = _recompute(_Inputs(x_ref, mu_ref, var_ref, pt_ref, chan_ref), **static,
                   shifts=(shift_ref[...], sq_shift_ref[...]))
    _, direct, dvar = _cotangents(f, g_ref, chan_ref)
    dvar_in = jnp.where(f["var_in_raw"] > 0, (1.0 - f["lv"]) * dvar, 0.0)
    dm_mu = (-(1.0 - f["lm"]) * direct - 2.0 * f["mu_c"] * dvar_in).astype(f["ph"].dtype)
    dm_sq = dvar_in.astype(f["ph"].dtype)
    p = p_ref[...]  # source x target
    d_ph = jnp.dot(p, dm_mu, preferred_element_type=_F32)
    d_sq = jnp.dot(p, dm_sq, preferred_element_type=_F32)
    c = channels
    # LayerNorm's part: d mu_LN (less 2 mu_LN d E[xs^2]) and d E[xs^2], per token, summed over
    # every head by the pass before
    grad = (direct + ln_ref[:, 0:1] / c + 2.0 * f["xs"] * ln_ref[:, 1:2] / c
            + d_ph + 2.0 * f["ph"].astype(_F32) * d_sq)
    xs = f["xs"]
    dx = f["rs"] * (grad - xs * jnp.mean(grad * xs, axis=1, keepdims=True))
    valid = f["valid"]
    _store(dx_ref, dx.astype(dx_ref.dtype), valid)
    for ref, value in ((tok_mu_ref, f["ph"]), (tok_sq_ref, f["sq"]), (dm_mu_ref, dm_mu),
                       (dm_sq_ref, dm_sq)):
        _store(ref, value, valid)


def _load(ref, mask):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.load(ref, mask=mask, other=0.0)


def _store(ref, value, mask):
    from jax.experimental.pallas import triton as pltriton
    pltriton.store(ref, value, mask=mask)


class _Call(NamedTuple):
    """What the three kernels share: shapes, the per-head matrices and per-channel rows."""

    b: int
    t: int
    c: int
    h: int
    d: int
    tp: int
    p: jax.Array     # (h, tp, tp) P padded, source x target, the moments' dtype
    pt: jax.Array    # its transpose
    chan: jax.Array  # (4, c)


def _prepare(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any) -> _Call:
    b, t, c = x.shape
    h, pre = cfg.heads, cfg.pre
    d = c // h
    if not fits(d):
        raise ValueError(f"norm 'dtn': kernel='pallas' needs a head width that is a power of two "
                         f"of at least 16, got {d} (C={c}, heads={h}); accepted: kernel='xla'")
    tp = max(_next_pow2(t), 16)
    p = dtn_moments.position_weights(params["pos_proj"], cfg.side)  # (h, src, tgt)
    # zero rows and columns for the prefix tokens and the padding
    p = jnp.pad(p, ((0, 0), (pre, tp - t), (pre, tp - t))).astype(cfg.moments_dtype)
    sig = jax.nn.sigmoid
    mean_gate = sig(params["mean_gate"]) if cfg.mix_mean else jnp.ones((h,), _F32)
    chan = jnp.stack([jnp.repeat(sig(params["var_gate"]), d), jnp.repeat(mean_gate, d),
                      params["scale"].astype(_F32), params["bias"].astype(_F32)])
    return _Call(b, t, c, h, d, tp, p, jnp.swapaxes(p, 1, 2), chan)


def _pallas(kernel, call: _Call, cfg: Any, in_specs, out_specs, out_shape, name: str):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    on_gpu = jax.default_backend() == "gpu"
    static = dict(t=call.t, pre=cfg.pre, epsilon=cfg.epsilon)
    if kernel is _dx_kernel:
        static["channels"] = call.c
    return pl.pallas_call(
        functools.partial(kernel, **static), out_shape=out_shape, grid=(call.b, call.h),
        in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1) if on_gpu else None,
        interpret=not on_gpu, name=name)


def _specs(call: _Call, backward: bool) -> list[Any]:
    """BlockSpecs of the inputs the kernels share: x, mu_LN, var_LN, P^T, the channel rows (and
    in the backward the two shifts and g)."""
    from jax.experimental import pallas as pl
    tp, d = call.tp, call.d
    tokens = pl.BlockSpec((None, tp, d), lambda i, j: (i, 0, j))
    column = pl.BlockSpec((None, tp, 1), lambda i, j: (i, 0, 0))
    head = pl.BlockSpec((None, tp, tp), lambda i, j: (j, 0, 0))
    specs = [tokens, column, column, head, pl.BlockSpec((4, d), lambda i, j: (0, j))]
    if backward:
        shift = pl.BlockSpec((None, 1, d), lambda i, j: (i, 0, j))
        specs += [shift, shift, tokens]
    return specs


def forward(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any
            ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """(y, residuals) of x (B, T, C): y DTN's output in x's dtype; the residuals are the two
    (B, 1, C) token shifts (as norms/dtn_half.py computes them) and LayerNorm's (B, T)
    statistics. ``cfg`` is norms/dtn.py's ``_Static``."""
    from jax.experimental import pallas as pl
    call = _prepare(x, params, cfg)
    mu_ln, var_ln = ln_statistics(x, call.h, cfg.epsilon, cfg.ln_unbiased)
    shift = pl.BlockSpec((None, 1, call.d), lambda i, j: (i, 0, j))
    shift_shape = jax.ShapeDtypeStruct((call.b, 1, call.c), _F32)
    y, s, sq = _pallas(_forward_kernel, call, cfg, _specs(call, False),
                       (_specs(call, False)[0], shift, shift),
                       (jax.ShapeDtypeStruct(x.shape, x.dtype), shift_shape, shift_shape),
                       "dtn_forward")(x, mu_ln[..., None], var_ln[..., None], call.pt, call.chan)
    return y, (s, sq, mu_ln, var_ln)


def backward(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any,
             residuals: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array, dict]:
    """(d x, d params) of DTN at x for the output cotangent g: two kernels and dP's matmul."""
    from jax.experimental import pallas as pl
    shift, sq_shift, mu_ln, var_ln = residuals
    call = _prepare(x, params, cfg)
    b, t, c, h, d, tp = call.b, call.t, call.c, call.h, call.d, call.tp
    ins = (x, mu_ln[..., None], var_ln[..., None], call.pt, call.chan, shift, sq_shift, g)
    specs = _specs(call, True)
    token_sums, chan_sums = _pallas(
        _token_sums_kernel, call, cfg, specs,
        (pl.BlockSpec((None, None, tp, 2), lambda i, j: (i, j, 0, 0)),
         pl.BlockSpec((None, None, 4, d), lambda i, j: (i, j, 0, 0))),
        (jax.ShapeDtypeStruct((b, h, tp, 2), _F32), jax.ShapeDtypeStruct((b, h, 4, d), _F32)),
        "dtn_backward_sums")(*ins)
    dmu_ln, dvar_ln = jnp.moveaxis(jnp.sum(token_sums[:, :, :t], axis=1), -1, 0)  # (b, t) each
    kappa = c / (c - 1) if cfg.ln_unbiased else 1.0
    dm2_ln = jnp.where(var_ln > 0, dvar_ln * kappa, 0.0)  # d E[xs^2]; a clamped variance: none
    ln = jnp.stack([dmu_ln - 2 * mu_ln * dm2_ln, dm2_ln], -1)  # (b, t, 2)
    half = call.p.dtype
    by_head = pl.BlockSpec((None, tp, None, d), lambda i, j: (j, 0, i, 0))
    head_shape = jax.ShapeDtypeStruct((h, t, b, d), half)
    dx, tok_mu, tok_sq, dm_mu, dm_sq = _pallas(
        _dx_kernel, call, cfg,
        specs + [pl.BlockSpec((None, tp, tp), lambda i, j: (j, 0, 0)),
                 pl.BlockSpec((None, tp, 2), lambda i, j: (i, 0, 0))],
        (specs[0], by_head, by_head, by_head, by_head),
        (jax.ShapeDtypeStruct(x.shape, x.dtype),) + (head_shape,) * 4,
        "dtn_backward_dx")(*ins, call.p, ln)
    # dP[h, s, t] = sum over (b, d) of the tokens at s times the moments' cotangents at t: one
    # matmul per head over the long (b, d) axis, float32 sums (the softmax's backward subtracts
    # dP's weighted mean, which half precision would not survive)
    dims = (((2, 3), (2, 3)), ((0,), (0,)))
    precision = jax.lax.Precision.HIGHEST if half == _F32 else None
    dp = (jax.lax.dot_general(tok_mu, dm_mu, dims, precision=precision,
                              preferred_element_type=_F32)
          + jax.lax.dot_general(tok_sq, dm_sq, dims, precision=precision,
                                preferred_element_type=_F32))
    pre = cfg.pre
    _, p_vjp = jax.vjp(functools.partial(dtn_moments.position_weights, side=cfg.side),
                       params["pos_proj"])
    (dpos,) = p_vjp(dp[:, pre:, pre:])
    sums = jnp.sum(chan_sums, axis=0)  # (h, 4, d)
    per_channel = lambda k: sums[:, k].reshape(c)  # noqa: E731
    sig = jax.nn.sigmoid
    dgate = lambda name, k: jnp.sum(  # noqa: E731
        sums[:, k] * (sig(params[name]) * (1 - sig(params[name])))[:, None], -1)
    grads = {"scale": per_channel(0), "bias": per_channel(1), "pos_proj": dpos,
             "var_gate": dgate("var_gate", 2)}
    if cfg.mix_mean:
        grads["mean_gate"] = dgate("mean_gate", 3)
    return dx, grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dtn(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any) -> jax.Array:
    """DTN of ``x`` (B, T, C) with its forward and backward in Pallas kernels."""
    return forward(x, params, cfg)[0]


def _dtn_fwd(x, params, cfg):
    y, residuals = forward(x, params, cfg)
    return y, (x, params, residuals)


def _dtn_bwd(cfg, res, g):
    x, params, residuals = res
    return backward(x, params, cfg, residuals, g)


dtn.defvjp(_dtn_fwd, _dtn_bwd)

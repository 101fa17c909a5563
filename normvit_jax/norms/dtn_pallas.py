"""DTN in Pallas kernels (Triton on a GPU), forward and backward: the same function as
norms/dtn_half.py's (tested equal), for the half-precision path without pooling (head widths that
are powers of two >= 16), selected by the option ``kernel='pallas'``; where they do not apply
(float32 evaluation or export, pooling) norms/dtn.py runs XLA's formulation.

On a GPU, XLA runs DTN as chains of kernels around the moments' batched matmul, with the
per-element intermediates (the shifted tokens and their squares, the moments, their cotangents,
float32 partial products) written out and read back between them: a B/16 slot moves ~4.7 GB a
training step (``benchmarks.gpu_hlo``; LayerNorm ~1 GB), and the layer took 4.25x LayerNorm's
time on an H200. Every DTN statistic but LayerNorm's is per channel, and each channel's IN
moments need only its head's P: a program takes one sample and a block of one head's channels,
all tokens (its blocks padded to a power of two, as Triton's must be), and keeps everything
between reading x (and g) and writing its result in registers:

    RMS scaling -> the patch tokens' shifts -> moments = P^T [ph, ph^2 - sq_shift] (tensor-core
    matmuls, float32 sums) -> the mixed statistics -> y

taking the target tokens in chunks (a loop), so that only a chunk of P^T and of the
normalization's values are alive at once. The matmuls run over the tokens rounded up to 16, in
parts whose sizes are powers of two (``_parts``: 197 tokens as 128 + 64 + 16 sources, the targets
as whole chunks and such a tail), not over the padded block: 208 x 208 multiply-adds a channel
where 256 x 256 would be 1.51x that. What sums over a token's channels comes from XLA
around the kernels, per token and cheap:
- before the forward: the per-head RMS scaling and LayerNorm's statistics (one reduction of x);
- the forward kernel writes y and the two (B, 1, C) token shifts;
- the backward kernel recomputes the forward and writes the per-element part of d xs (through
  xs - mu, a chunk at a time, then through the moments: P times their cotangents, summed over
  the target chunks, added after a barrier), the
  moments' operands with their cotangents in (head, token, batch, width) layout, and its block's
  parts of the per-token sums (d mu_LN, d var_LN, the RMS backward's) and of the parameters';
- after it, one XLA fusion gives dx from those per-token sums, and XLA's matmul over the batch
  gives dP (the only sum over samples: one GEMM per head with K = B x 2d).

``FORWARD`` and ``BACKWARD`` (or the option ``pallas_tiling``) say how many channels a program
takes, how many targets a step, how many warps. The backward keeps x, the shifts and the
per-token statistics. The equations are norms/dtn_half.py's (its docstring); the moments stay
float32 in registers where the XLA path rounds them to bfloat16.

On a CPU the kernels run in Pallas's interpreter (slow: for tests, not for training); on a TPU
norms/dtn.py keeps XLA's path.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from normvit_jax.norms import dtn_moments

_F32 = jnp.float32


class Tiling(NamedTuple):
    """How a kernel cuts its work: ``block`` channels of one head a program, ``chunk`` target
    tokens a step of its loop, ``warps`` a program."""

    block: int
    chunk: int
    warps: int


# Chosen by what ptxas reports for an H100 (registers, spills; docs/benchmarks.md, "DTN in Pallas
# kernels"), not yet by timings: a whole head (64 channels) and all targets at once used every
# register and spilled 0.5-3 KB a thread; these spill nothing (forward 210 registers, backward
# 248) at B/16 and S/16, and take 197 targets as 3 x 64 + 16 and 13 x 16 rows (the backward's
# chunks of 32 with a tail of 16 spilled 120 bytes).
FORWARD = Tiling(block=32, chunk=64, warps=8)
BACKWARD = Tiling(block=16, chunk=16, warps=8)


def parse_tiling(text: str, norm_name: str = "dtn") -> tuple[Tiling, Tiling]:
    """'F:B' (the option ``pallas_tiling``), each 'channels/targets/warps' powers of two ->
    (forward, backward); a ValueError naming the option otherwise."""
    try:
        parts = [Tiling(*(int(v) for v in part.split("/"))) for part in str(text).split(":")]
        ok = len(parts) == 2 and all(v >= 1 and v & (v - 1) == 0 for p in parts for v in p)
        ok = ok and all(p.block >= 16 and p.chunk >= 16 for p in parts)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"norm {norm_name!r}: pallas_tiling={text!r} is not accepted; accepted: "
                         "None or 'F:B', each 'channels/targets/warps' powers of two, channels "
                         "and targets >= 16, e.g. '32/64/8:16/16/8'")
    return parts[0], parts[1]


def fits(head_width: int, backend: str = "gpu") -> bool:
    """Whether the kernels serve this head width on this backend: Triton's blocks and matmuls
    need a power of two, at least 16; they are Triton kernels, for a GPU (a CPU runs them in
    Pallas's interpreter, for tests; a TPU keeps XLA's path, which its compiler fuses itself)."""
    return backend in ("gpu", "cpu") and head_width >= 16 and head_width & (head_width - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class HeadStats(NamedTuple):
    """Per token: the RMS pre-scaling of each head and the means of the scaled tokens and their
    squares over its channels, (B, T, H); LayerNorm's statistics over all channels, (B, T)."""

    rs: jax.Array
    m1: jax.Array
    m2: jax.Array
    mu_ln: jax.Array
    var_ln: jax.Array  # clamped at 0, unbiased if the option says so


def head_statistics(x: jax.Array, heads: int, epsilon: float, unbiased: bool) -> HeadStats:
    """From the per-head sums of x and x^2, as norms/dtn.py computes them: one XLA reduction."""
    b, t, c = x.shape
    d = c // heads
    xh = x.astype(_F32).reshape(b, t, heads, d)
    s1, s2 = jnp.sum(xh, -1), jnp.sum(jnp.square(xh), -1)
    rs = jax.lax.rsqrt(s2 / d + epsilon)
    m1, m2 = rs * s1 / d, rs * rs * s2 / d
    mu = jnp.mean(m1, -1)
    var = jnp.maximum(jnp.mean(m2, -1) - jnp.square(mu), 0.0)
    return HeadStats(rs, m1, m2, mu, var * (c / (c - 1) if unbiased else 1.0))


class _Inputs(NamedTuple):
    """One program's refs: sample i's tokens in a block of one head's channels, what they are
    normalized by."""

    x: Any        # (tp, k) tokens, rows >= t out of bounds (masked)
    rs: Any       # (tp, 1) the head's RMS pre-scaling
    mu_ln: Any    # (tp, 1) LayerNorm statistics of the RMS-scaled tokens
    var_ln: Any
    pt: Any       # (tp, tp) P^T of the head: target x source, zero for prefix and padding
    chan: Any     # (4, k) the var gate's and the mean gate's sigmoids, scale, bias


def _scaled(ins: _Inputs, lo: int, n: int, t: int) -> tuple[Any, Any]:
    """Rows lo..lo+n of the RMS-scaled tokens (float32) and which of them are tokens."""
    k = ins.x.shape[1]
    valid = jax.lax.broadcasted_iota(jnp.int32, (n, k), 0) + lo < t
    column = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0) + lo < t
    x = _load(ins.x.at[_ds(lo, n), :], valid).astype(_F32)
    return x * _load(ins.rs.at[_ds(lo, n), :], column), valid


def _parts(lo: int, end: int) -> tuple[tuple[int, int], ...]:
    """Row ranges (lo, n) from lo to ``end`` rounded up to 16 (the least a tensor-core matmul
    takes), their sizes powers of two (Triton's blocks are), largest first: each lo is then a
    multiple of its n where lo is a multiple of the largest. 197 tokens are 128 + 64 + 16 = 208
    rows of the moments' matmuls, where one block would be 256."""
    parts, m = [], -(-(end - lo) // 16) * 16
    for bit in reversed(range(m.bit_length())):
        if m & (1 << bit):
            parts.append((lo, 1 << bit))
            lo += 1 << bit
    return tuple(parts)


def _tokens(ins: _Inputs, *, t: int, pre: int, shifts=None) -> dict[str, Any]:
    """Every source token of the block, in ``_parts``: the shifts and the moments' matmul
    operands, a tuple of row parts each."""
    parts = _parts(0, t)
    scaled = []
    for lo, n in parts:
        xs, valid = _scaled(ins, lo, n, t)
        scaled.append((xs, valid & (jax.lax.broadcasted_iota(jnp.int32, xs.shape, 0) + lo >= pre)))
    if shifts is None:  # the patch tokens' mean and their squares' centring constant (dtn.py)
        count = t - pre
        masked = [jnp.where(patch, xs, 0.0) for xs, patch in scaled]
        shift = sum(jnp.sum(v, axis=0, keepdims=True) for v in masked) / count
        sq_shift = jnp.maximum(sum(jnp.sum(v * v, axis=0, keepdims=True) for v in masked)
                               / count - shift * shift, 0.0)
    else:
        shift, sq_shift = shifts
    half = ins.pt.dtype  # the matmuls' operands, as XLA's path
    ph = [jnp.where(patch, xs - shift, 0.0) for xs, patch in scaled]
    sq = [jnp.where(patch, v * v - sq_shift, 0.0) for v, (_, patch) in zip(ph, scaled)]
    return dict(parts=parts, shift=shift, sq_shift=sq_shift,
                ph=tuple(v.astype(half) for v in ph), sq=tuple(v.astype(half) for v in sq))


def _rows(ins: _Inputs, tok: dict[str, Any], lo: int, n: int, *, t: int, pre: int,
          epsilon: float) -> dict[str, Any]:
    """DTN's forward for target rows lo..lo+n in float32: P^T's rows times every source token.
    Taking the targets in chunks keeps a program's registers to one chunk of P and of the
    normalization's values (the whole (256 x 256) P^T tile alone was 128 registers a thread)."""
    xs, valid = _scaled(ins, lo, n, t)
    patch = valid & (jax.lax.broadcasted_iota(jnp.int32, xs.shape, 0) + lo >= pre)
    pts = [ins.pt.at[_ds(lo, n), _ds(src, size)][...] for src, size in tok["parts"]]
    mu_c = functools.reduce(jnp.add, [_dot(pt, ph) for pt, ph in zip(pts, tok["ph"])])
    m2_c = functools.reduce(jnp.add, [_dot(pt, sq) for pt, sq in zip(pts, tok["sq"])])
    var_in_raw = m2_c + tok["sq_shift"] - mu_c * mu_c
    var_in = jnp.maximum(var_in_raw, 0.0)
    mu_in = mu_c + tok["shift"]
    column = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0) + lo < t
    mu_ln = _load(ins.mu_ln.at[_ds(lo, n), :], column)
    var_ln = _load(ins.var_ln.at[_ds(lo, n), :], column)
    lv = jnp.where(patch, ins.chan[0:1, :], 1.0)  # a prefix token: LayerNorm's statistics
    lm = jnp.where(patch, ins.chan[1:2, :], 1.0)
    r = jax.lax.rsqrt(lv * var_ln + (1.0 - lv) * var_in + epsilon)
    yhat = (xs - (lm * mu_ln + (1.0 - lm) * mu_in)) * r
    return dict(valid=valid, patch=patch, xs=xs, mu_c=mu_c, var_in_raw=var_in_raw,
                var_in=var_in, mu_in=mu_in, mu_ln=mu_ln, var_ln=var_ln, lv=lv, lm=lm, r=r,
                yhat=yhat)


def _aligned(value: Any, n: int) -> Any:
    """``value``, declared a multiple of n to the compiler (aligned loads and stores)."""
    from jax.experimental import pallas as pl
    return pl.multiple_of(value, n)


def _ds(lo: Any, n: int) -> Any:
    from jax.experimental import pallas as pl
    return pl.ds(lo, n)


def _target_steps(tp: int, t: int, chunk: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(rows, count, tail) of the target chunks: ``count`` chunks of ``rows`` in a loop, not
    unrolled, so that the compiler cannot interleave chunks and keep several alive (unrolled, the
    kernels spilled), then the rest of the tokens in ``_parts``, each a step of its own: 197
    tokens in chunks of 64 are 3 x 64 + 16 rows, not 4 x 64."""
    n = min(tp, chunk)
    count, tail = t // n, _parts(t // n * n, t) if t % n else ()
    if tail == ((count * n, n),):
        return n, count + 1, ()
    return n, count, tail


def _forward_kernel(x_ref, rs_ref, mu_ref, var_ref, pt_ref, chan_ref, y_ref, shift_ref,
                    sq_shift_ref, *, t: int, pre: int, epsilon: float, chunk: int):
    ins = _Inputs(x_ref, rs_ref, mu_ref, var_ref, pt_ref, chan_ref)
    tok = _tokens(ins, t=t, pre=pre)
    n, count, tail = _target_steps(x_ref.shape[0], t, chunk)

    def step(lo, n):
        f = _rows(ins, tok, lo, n, t=t, pre=pre, epsilon=epsilon)
        y = f["yhat"] * chan_ref[2:3, :] + chan_ref[3:4, :]
        _store(y_ref.at[_ds(lo, n), :], y.astype(y_ref.dtype), f["valid"])

    def chunk_step(i, carry):
        step(_aligned(i * n, n), n)
        return carry

    jax.lax.fori_loop(0, count, chunk_step, 0)
    for lo, size in tail:
        step(lo, size)
    shift_ref[...] = tok["shift"]
    sq_shift_ref[...] = tok["sq_shift"]


def _backward_kernel(x_ref, rs_ref, mu_ref, var_ref, pt_ref, chan_ref, shift_ref, sq_shift_ref,
                     g_ref, p_ref, e_ref, tok_mu_ref, tok_sq_ref, dm_mu_ref,
                     dm_sq_ref, token_ref, chan_out_ref, *, t: int, pre: int, epsilon: float,
                     chunk: int):
    """Everything of the backward that needs the moments: the per-element part of d xs (``e``:
    through xs - mu and through the IN moments), the moments' matmul operands with
    their cotangents (for dP), and this block's part of the sums over its channels per token and
    over the tokens per channel. What is left (LayerNorm's and the RMS scaling's parts of dx)
    needs only per-token sums over every head: one XLA fusion after it."""
    ins = _Inputs(x_ref, rs_ref, mu_ref, var_ref, pt_ref, chan_ref)
    tok = _tokens(ins, t=t, pre=pre, shifts=(shift_ref[...], sq_shift_ref[...]))
    tp, k = x_ref.shape
    half = pt_ref.dtype  # the matmuls' operands
    n, count, tail = _target_steps(tp, t, chunk)

    def step(lo, n, carry):
        e, sums = carry
        f = _rows(ins, tok, lo, n, t=t, pre=pre, epsilon=epsilon)
        rows = lambda ref: ref.at[_ds(lo, n), :]  # noqa: E731
        g = _load(rows(g_ref), f["valid"]).astype(_F32)
        dyhat = g * chan_ref[2:3, :]
        direct = dyhat * f["r"]  # d xs through xs - mu; d mu = -direct
        dvar = -0.5 * dyhat * f["yhat"] * f["r"] * f["r"]
        dvar_in = jnp.where(f["var_in_raw"] > 0, (1.0 - f["lv"]) * dvar, 0.0)
        dm_mu = (-(1.0 - f["lm"]) * direct - 2.0 * f["mu_c"] * dvar_in).astype(half)
        dm_sq = dvar_in.astype(half)
        # e's part through xs - mu, a chunk of rows; its part through the moments is a sum over
        # every chunk, added after the loop
        for ref, value in ((e_ref, direct), (dm_mu_ref, dm_mu), (dm_sq_ref, dm_sq)):
            _store(rows(ref), value.astype(ref.dtype), f["valid"])
        token_ref[_ds(lo, n), 0:1] = jnp.sum(-f["lm"] * direct, axis=1, keepdims=True)
        token_ref[_ds(lo, n), 1:2] = jnp.sum(f["lv"] * dvar, axis=1, keepdims=True)
        token_ref[_ds(lo, n), 2:3] = jnp.sum(direct * f["xs"], axis=1, keepdims=True)
        patch = f["patch"]
        parts = (g * f["yhat"], g, jnp.where(patch, (f["var_ln"] - f["var_in"]) * dvar, 0.0),
                 jnp.where(patch, (f["mu_ln"] - f["mu_in"]) * -direct, 0.0))
        sums = tuple(acc + jnp.sum(v, axis=0, keepdims=True) for acc, v in zip(sums, parts))
        # d xs through the moments, d ph + 2 ph d sq, per source part: P's rows of the part,
        # these targets; both matmuls (over targets) in one sum, ph being the source rows' own
        # (one accumulator fewer to hold)
        e = tuple(
            acc + _dot(p, dm_mu) + 2.0 * ph.astype(_F32) * _dot(p, dm_sq)
            for acc, ph, p in zip(e, tok["ph"], (p_ref.at[_ds(src, size), _ds(lo, n)][...]
                                                 for src, size in tok["parts"])))
        return e, sums

    carry = (tuple(jnp.zeros((size, k), _F32) for _, size in tok["parts"]),
             tuple(jnp.zeros((1, k), _F32) for _ in range(4)))  # scale, bias, the two gates
    carry = jax.lax.fori_loop(0, count, lambda i, carry: step(_aligned(i * n, n), n, carry),
                              carry)
    for lo, size in tail:
        carry = step(lo, size, carry)
    e, sums = carry
    _barrier()  # every thread's stores of e's first part done and visible before it is read
    for (src, size), e_part, ph, sq in zip(tok["parts"], e, tok["ph"], tok["sq"]):
        xs, valid = _scaled(ins, src, size, t)  # read again: kept from the start, they spilled
        rows = lambda ref: ref.at[_ds(src, size), :]  # noqa: E731
        direct = _load(rows(e_ref), valid).astype(_F32)
        _store(rows(e_ref), (direct + e_part).astype(e_ref.dtype), valid)
        _store(rows(tok_mu_ref), ph, valid)
        _store(rows(tok_sq_ref), sq, valid)
        # the moments' part's share (rows past the parts are never read: dx's fusion takes t)
        token_ref[_ds(src, size), 3:4] = jnp.sum(e_part * xs, axis=1, keepdims=True)
    for row, value in enumerate(sums):
        chan_out_ref[row:row + 1, :] = value


def _dot(a: Any, b: Any) -> Any:
    """A matmul in a kernel, float32 sums: half operands on the tensor cores; float32 operands
    (the tests' exact path) in full float32, where Triton's default would be TF32."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


def _load(ref, mask):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.load(ref, mask=mask, other=0.0)


def _barrier() -> None:
    """All threads of the program wait here: global stores before it are visible after it."""
    if jax.default_backend() == "gpu":  # the interpreter runs a program's code in order
        from jax.experimental.pallas import triton as pltriton
        pltriton.debug_barrier()


def _store(ref, value, mask):
    from jax.experimental.pallas import triton as pltriton
    pltriton.store(ref, value, mask=mask)


class _Call(NamedTuple):
    """What the kernels share: shapes, the per-head matrices and the per-channel rows."""

    b: int
    t: int
    c: int
    h: int
    d: int
    k: int           # channels a program takes
    tp: int          # tokens padded to a power of two
    tiling: Tiling
    p: jax.Array     # (h, tp, tp) P padded, source x target, the moments' dtype
    pt: jax.Array    # its transpose
    chan: jax.Array  # (4, c)


def _prepare(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any, tiling: Tiling) -> _Call:
    b, t, c = x.shape
    h, pre = cfg.heads, cfg.pre
    d = c // h
    if not fits(d):  # the head width; the backend is the caller's (norms/dtn.py)
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
    return _Call(b, t, c, h, d, min(d, tiling.block), tp, tiling, p, jnp.swapaxes(p, 1, 2), chan)


def _pallas(kernel, call: _Call, cfg: Any, in_specs, out_specs, out_shape, name: str):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    on_gpu = jax.default_backend() == "gpu"
    return pl.pallas_call(
        functools.partial(kernel, t=call.t, pre=cfg.pre, epsilon=cfg.epsilon,
                          chunk=call.tiling.chunk),
        out_shape=out_shape, grid=(call.b, call.c // call.k), in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=(pltriton.CompilerParams(num_warps=call.tiling.warps, num_stages=1)
                         if on_gpu else None),
        interpret=not on_gpu, name=name)


def _specs(call: _Call, backward: bool) -> list[Any]:
    """BlockSpecs over the grid (sample i, channel block j): x, the head's RMS scaling, mu_LN,
    var_LN, the head's P^T, the channel rows; in the backward also the two shifts, g and P."""
    from jax.experimental import pallas as pl
    tp, k = call.tp, call.k
    per_head = call.d // k  # channel blocks a head has
    tokens = pl.BlockSpec((None, tp, k), lambda i, j: (i, 0, j))
    column = pl.BlockSpec((None, tp, 1), lambda i, j: (i, 0, 0))
    head = pl.BlockSpec((None, tp, tp), lambda i, j: (j // per_head, 0, 0))
    specs = [tokens, pl.BlockSpec((None, tp, 1), lambda i, j: (i, 0, j // per_head)), column,
             column, head, pl.BlockSpec((4, k), lambda i, j: (0, j))]
    if backward:
        specs += [_shift_spec(call), _shift_spec(call), tokens, head]
    return specs


def _shift_spec(call: _Call) -> Any:
    """The BlockSpec of a (B, 1, C) token shift: sample i's channel block j."""
    from jax.experimental import pallas as pl
    return pl.BlockSpec((None, 1, call.k), lambda i, j: (i, 0, j))


def forward(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any
            ) -> tuple[jax.Array, tuple[Any, ...]]:
    """(y, residuals) of x (B, T, C): y DTN's output in x's dtype; the residuals are the two
    (B, 1, C) token shifts (as norms/dtn_half.py computes them) and the per-token statistics.
    ``cfg`` is norms/dtn.py's ``_Static``."""
    call = _prepare(x, params, cfg, cfg.tiling[0] if cfg.tiling else FORWARD)
    st = head_statistics(x, call.h, cfg.epsilon, cfg.ln_unbiased)
    shift = _shift_spec(call)
    shift_shape = jax.ShapeDtypeStruct((call.b, 1, call.c), _F32)
    specs = _specs(call, False)
    y, s, sq = _pallas(_forward_kernel, call, cfg, specs, (specs[0], shift, shift),
                       (jax.ShapeDtypeStruct(x.shape, x.dtype), shift_shape, shift_shape),
                       "dtn_forward")(x, st.rs, st.mu_ln[..., None], st.var_ln[..., None],
                                      call.pt, call.chan)
    return y, (s, sq, st)


def backward(x: jax.Array, params: Mapping[str, jax.Array], cfg: Any,
             residuals: tuple[Any, ...], g: jax.Array) -> tuple[jax.Array, dict]:
    """(d x, d params) of DTN at x for the output cotangent g: one kernel, dx's XLA fusion and
    dP's matmul."""
    from jax.experimental import pallas as pl
    shift, sq_shift, st = residuals
    call = _prepare(x, params, cfg, cfg.tiling[1] if cfg.tiling else BACKWARD)
    b, t, c, h, d, k, tp = call.b, call.t, call.c, call.h, call.d, call.k, call.tp
    blocks = c // k
    half = call.p.dtype
    by_head = pl.BlockSpec((None, tp, None, k), lambda i, j: (j // (d // k), 0, i, j % (d // k)))
    head_shape = jax.ShapeDtypeStruct((h, t, b, d), half)
    specs = _specs(call, True)  # specs[0]: x's blocks, which e's are too
    e, tok_mu, tok_sq, dm_mu, dm_sq, token_sums, chan_sums = _pallas(
        _backward_kernel, call, cfg, specs,
        (specs[0], by_head, by_head, by_head, by_head,
         pl.BlockSpec((None, None, tp, 4), lambda i, j: (i, j, 0, 0)),
         pl.BlockSpec((None, None, 4, k), lambda i, j: (i, j, 0, 0))),
        (jax.ShapeDtypeStruct(x.shape, half),) + (head_shape,) * 4
        + (jax.ShapeDtypeStruct((b, blocks, tp, 4), _F32),
           jax.ShapeDtypeStruct((b, blocks, 4, k), _F32)),
        "dtn_backward")(x, st.rs, st.mu_ln[..., None], st.var_ln[..., None], call.pt, call.chan,
                        shift, sq_shift, g, call.p)

    # LayerNorm's part and the RMS pre-scaling's, per token (dtn_half.py's equations):
    # dxs = e + dmu_LN'/C + 2 xs dm2_LN/C, dx = rs (dxs - xs mean_head(dxs xs)) per head
    sums = token_sums[:, :, :t]  # (b, blocks, t, 4)
    dmu_ln, dvar_ln = jnp.sum(sums[..., 0], 1), jnp.sum(sums[..., 1], 1)  # (b, t)
    e_xs = jnp.moveaxis(jnp.sum((sums[..., 2] + sums[..., 3]).reshape(b, h, d // k, t), 2), 1, -1)
    kappa = c / (c - 1) if cfg.ln_unbiased else 1.0
    dm2_ln = jnp.where(st.var_ln > 0, dvar_ln * kappa, 0.0) / c  # a clamped variance: none
    dmu_ln = (dmu_ln - 2 * st.mu_ln * dm2_ln * c) / c
    mean_dxs_xs = e_xs / d + dmu_ln[..., None] * st.m1 + 2 * dm2_ln[..., None] * st.m2
    xs = x.astype(_F32).reshape(b, t, h, d) * st.rs[..., None]
    dxs = e.astype(_F32).reshape(b, t, h, d) + dmu_ln[..., None, None] \
        + 2 * xs * dm2_ln[..., None, None]
    dx = (st.rs[..., None] * (dxs - xs * mean_dxs_xs[..., None])).reshape(b, t, c)

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
    per_channel = jnp.moveaxis(jnp.sum(chan_sums, axis=0), 1, 0).reshape(4, c)
    sig = jax.nn.sigmoid
    dgate = lambda name, row: jnp.sum(  # noqa: E731
        (per_channel[row] * jnp.repeat(sig(params[name]) * (1 - sig(params[name])), d)
         ).reshape(h, d), -1)
    grads = {"scale": per_channel[0], "bias": per_channel[1], "pos_proj": dpos,
             "var_gate": dgate("var_gate", 2)}
    if cfg.mix_mean:
        grads["mean_gate"] = dgate("mean_gate", 3)
    return dx.astype(x.dtype), grads


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

"""DTN's inter-token (IN) moments: one batched matmul over heads, P^h (sources x targets) applied to
the shifted tokens and their squares.

    moments[b, t, h, :] = sum_s P[h, s, t] * [x, x^2][b, s, h, :]

Two precisions (docs/norms.md, "dtn: precision"):
- float32 operands at ``Precision.HIGHEST``: exact float32, the CPU/float32 path (what the
  float32 parity tests check);
- a half dtype (bfloat16) for both operands with float32 accumulation, the sums rounded to the
  half dtype on output (half the bytes of DTN's largest tensors): a GPU or TPU runs it on its
  matrix units. The backward is written out (custom_vjp) so that its two
  matmuls (d tokens = P . d moments, dP = tokens . d moments) also take half operands: autodiff of a
  mixed-precision dot would promote the float32 cotangent and run the matmul in float32.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# P first: (h, s, t) x (b, s, h, d) -> (h, t, b, d), batch h, contract s: per head one GEMM
# (t x s) . (s x b*d) with the large N = b*d, and the output's innermost axis is d, as the
# tokens' is, so every layout change around the matmul only permutes contiguous rows of d
# (the tokens-first order gives (h, b, d, t): t innermost, a full transpose back).
_FWD = (((1,), (1,)), ((0,), (2,)))


def relative_offsets(side: int) -> np.ndarray:
    """(N, N, 3) offsets [source i, target j] = (dx, dy, dx^2+dy^2), target minus source, tokens
    row-major, x along columns and y along rows."""
    rows, cols = np.divmod(np.arange(side * side), side)
    dx = cols[None, :] - cols[:, None]
    dy = rows[None, :] - rows[:, None]
    return np.stack([dx, dy, dx * dx + dy * dy], axis=-1).astype(np.float32)


def position_weights(pos_proj: jax.Array, side: int) -> jax.Array:
    """P (H, N_src, N_tgt) of a side x side grid: softmax over sources of the offsets' logits."""
    logits = jnp.einsum("ijd,dh->hij", jnp.asarray(relative_offsets(side)), pos_proj,
                        precision=jax.lax.Precision.HIGHEST)
    return jax.nn.softmax(logits, axis=1)


def _dot(a: jax.Array, b: jax.Array, dims: Any, precision: Any = None,
         out: Any = jnp.float32) -> jax.Array:
    """dot_general with float32 sums, its result in ``out``. XLA:CPU has no half x half -> float32
    kernel for every layout ("Unsupported element type for DotThunk"): there the half operands
    are widened, which computes the same products exactly (a product of two bfloat16 numbers fits
    in float32), and the float32 sums are rounded to ``out`` as a GPU's GEMM rounds them."""
    if a.dtype != jnp.float32 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32).astype(out)
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out)


def _fwd_dot(tokens: jax.Array, p: jax.Array, precision: Any, out: Any = jnp.float32
             ) -> jax.Array:
    moments = _dot(p, tokens, _FWD, precision, out)  # (h, t, b, d)
    return jnp.transpose(moments, (2, 1, 0, 3))  # (b, t, h, d)


def half_moments(tokens: jax.Array, p: jax.Array) -> jax.Array:
    """(b, s, h, 2d) half-dtype tokens, P (h, s, t) float32 -> (b, t, h, 2d) moments in the half
    dtype: half operands, float32 sums rounded on the way out. The moments are means of centred
    values (module docstring of norms/dtn.py), which the half dtype holds to 2^-9 of their size,
    and half the bytes of the largest tensors DTN writes and reads."""
    return _fwd_dot(tokens, p.astype(tokens.dtype), None, tokens.dtype)


def half_moments_vjp(tokens: jax.Array, p: jax.Array, g: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """(d tokens in the half dtype, dP in float32) of ``half_moments`` for the cotangent ``g``."""
    half = tokens.dtype
    g = g.astype(half)  # (b, t, h, d): the cotangent in the operands' half dtype
    # d tokens[b, s, h, d] = sum_t P[h, s, t] g[b, t, h, d]
    dt = _dot(p.astype(half), g, (((2,), (1,)), ((0,), (2,))))  # (h, s, b, d)
    dt = jnp.transpose(dt, (2, 1, 0, 3)).astype(half)
    # dP[h, s, t] = sum_{b, d} tokens[b, s, h, d] g[b, t, h, d], kept in float32: the softmax's
    # backward subtracts its weighted mean, which a half-precision dP would not survive.
    # Both operands as (h, tokens, b*d), the layout the two other matmuls read and write: one
    # GEMM per head with the long axis innermost in both (contracting (b, d) in place, XLA:GPU
    # transposed both operands to (h, b, d, tokens) first: ~1.4 GB of copies a B/16 slot).
    b, s, h, e = tokens.shape
    rows = lambda a: jnp.transpose(a, (2, 1, 0, 3)).reshape(h, a.shape[1], b * e)  # noqa: E731
    dp = _dot(rows(tokens), rows(g), (((2,), (2,)), ((0,), (0,))))  # (h, s, t)
    return dt, dp


_half_moments = jax.custom_vjp(half_moments)
_half_moments.defvjp(lambda tokens, p: (half_moments(tokens, p), (tokens, p)),
                     lambda res, g: half_moments_vjp(*res, g))


def in_moments(tokens: jax.Array, p: jax.Array, dtype: Any) -> jax.Array:
    """(b, s, h, 2d) float32 tokens (already shifted) and P (h, s, t) float32 -> (b, t, h, 2d)
    float32 weighted sums. ``dtype`` float32: exact; a half dtype: half operands, float32 sums."""
    if jnp.dtype(dtype) == jnp.float32:
        return _fwd_dot(tokens, p, jax.lax.Precision.HIGHEST)
    return _half_moments(tokens.astype(dtype), p).astype(jnp.float32)

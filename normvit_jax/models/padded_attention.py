"""Attention with the token axis padded to a multiple, for cuDNN's fused attention.

JAX's cuDNN flash attention (``jax.nn.dot_product_attention(..., implementation='cudnn')``)
refuses odd sequence lengths in training, a ViT's 197 tokens among them ("Unsupported sequence
length Q 197, KV 197": JAX's own check, which counts its placeholder for "no bias" as a bias; jax
0.10 and 0.11), so the model fell back to XLA's attention on GPU. Padding the tokens to a multiple
of 16 (197 -> 208) and passing the true length as ``query_seq_lengths``/``key_value_seq_lengths``
lets cuDNN run: the padded keys are masked out of every softmax and the padded query rows come
back as zeros, which are sliced off. Measured on an H100 at ViT-B/16 shapes (B=256, H=12, Dh=64,
bfloat16): 1.25 ms per layer forward+backward against 3.34 ms for XLA's attention at 197 tokens
(docs/benchmarks.md).

On GPU the model calls this with ``implementation='cudnn'`` (see ``choose_implementation``); on
CPU the same function with ``implementation='xla'`` or ``None`` computes the same values (tested in
tests/test_padded_attention.py against a float64 numpy reference, gradients included).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's fused attention takes half dtypes only


def padded_length(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= n."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    return -(-n // multiple) * multiple


def _pad_tokens(x: jax.Array, length: int) -> jax.Array:
    extra = length - x.shape[1]
    return x if extra == 0 else jnp.pad(x, [(0, 0), (0, extra), (0, 0), (0, 0)])


def padded_dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, multiple: int = 16,
                                 implementation: str | None = None, scale: float | None = None
                                 ) -> jax.Array:
    """``jax.nn.dot_product_attention`` on (B, T, H, Dh) queries and (B, S, H, Dh) keys/values,
    computed on token axes zero-padded to a multiple of ``multiple`` with the padding masked.

    Returns (B, T, H, Dh), equal to the unpadded attention (the padded keys get no weight; the
    padded query rows are dropped). When both lengths are multiples already, nothing is padded.
    ``implementation``: 'cudnn' on GPU in bfloat16/float16, 'xla' or None elsewhere.
    """
    b, t = q.shape[0], q.shape[1]
    s = k.shape[1]
    tp, sp = padded_length(t, multiple), padded_length(s, multiple)
    if tp == t and sp == s:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation)
    out = jax.nn.dot_product_attention(
        _pad_tokens(q, tp), _pad_tokens(k, sp), _pad_tokens(v, sp), scale=scale,
        query_seq_lengths=jnp.full((b,), t, jnp.int32),
        key_value_seq_lengths=jnp.full((b,), s, jnp.int32),
        implementation=implementation)
    return out[:, :t]


def choose_implementation(dtype: Any, backend: str | None = None) -> str | None:
    """'cudnn' where cuDNN's fused attention applies (a GPU backend, a half dtype), else None
    (JAX's default, XLA's attention). ``backend`` defaults to ``jax.default_backend()``."""
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda") and any(np.dtype(dtype) == np.dtype(d) for d in CUDNN_DTYPES):
        return "cudnn"
    return None

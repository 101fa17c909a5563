"""XLA:CPU speed workarounds of ``model.fusion_barriers``: where XLA:CPU fuses an elementwise chain
into every consumer and recomputes it, these store it once. None of them changes what is computed.

``dense``: a matmul whose custom backward reads a stored input and output gradient;
``grad_barrier``: an identity whose backward stores the cotangent; ``barriers_on``: the setting.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype: Any,
          barriers: bool = False) -> jax.Array:
    """x (N, K) @ kernel (K, F) + bias, computed in ``dtype``.

    ``barriers`` (XLA:CPU, see ``grad_barrier``): a custom backward that reads a stored input and
    a stored output gradient (so XLA's transposing copies for the weight gradient are plain
    copies, not a re-run of the norm or GELU that produced them), and whose bias gradient sums
    the stored gradient (fused with its producer, that column sum ran 10x slower).
    """
    k, b = kernel.astype(dtype), bias.astype(dtype)
    if barriers:
        return _dense_stored(x.astype(dtype), k, b)
    return jnp.dot(x.astype(dtype), k) + b


@jax.custom_vjp
def _dense_stored(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(x, w) + b


def _dense_stored_fwd(x, w, b):
    x = jax.lax.optimization_barrier(x)
    return jnp.dot(x, w) + b, (x, w)


def _dense_stored_bwd(res, dy):
    x, w = res
    dy = jax.lax.optimization_barrier(dy)
    dx = jnp.dot(dy, w.T)
    dw = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))
    db = jnp.sum(dy, axis=0)
    return dx, dw, db


_dense_stored.defvjp(_dense_stored_fwd, _dense_stored_bwd)


@jax.custom_vjp
def grad_barrier(x: jax.Array) -> jax.Array:
    """Identity whose backward passes the cotangent through ``lax.optimization_barrier``.

    Why: the gradient of the residual stream is a sum over every block above; XLA:CPU fuses that
    elementwise chain into each consumer instead of storing it, and the consumers include the
    transposing copies of the weight-gradient matmuls, so the chain is recomputed, in a strided
    order, once per block (a ViT-Ti/4 step took 4.7x longer, docs/benchmarks.md). A barrier stores
    it once. XLA:CPU drops barriers before fusion unless ``--xla_disable_hlo_passes=
    cse_barrier_expander`` is set (the benchmarks' 'tuned' preset); otherwise this is a no-op.
    """
    return x


def _grad_barrier_fwd(x):
    return x, None


def _grad_barrier_bwd(_, g):
    return (jax.lax.optimization_barrier(g),)


grad_barrier.defvjp(_grad_barrier_fwd, _grad_barrier_bwd)


def barriers_on(setting: str) -> bool:
    """``model.fusion_barriers``: 'auto' places them when compiling for CPU (the only backend
    where they were measured to help), 'on'/'off' force it."""
    return setting == "on" or (setting == "auto" and jax.default_backend() == "cpu")

"""The gradients' global L2 norm (the logged ``grad_norm``, the clip) in few kernels on a GPU/TPU.

``optax.tree.norm`` sums every parameter's squares in its own reduction: XLA:GPU runs each as a
kernel, about 230 of the ~1,100 kernels of a ViT-B/16 train step, most of them over a few thousand
numbers (``benchmarks.gpu_hlo``). Here the squares of the leaves that share a shape are summed by
one variadic reduce, a kernel per shape (22 at B/16), reading the same bytes once. On the CPU the
norm is optax's, in its order: its float32 rounding is what the pinned demos computed.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from normvit_jax.norms._common import variadic_sums


def grouped_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of ``tree``, with one reduction per distinct (shape, dtype)."""
    groups: dict[tuple, list[jax.Array]] = {}
    for leaf in jax.tree.leaves(tree):
        leaf = jnp.asarray(leaf)
        if jnp.dtype(leaf.dtype).itemsize < 4:  # half-precision leaves: squares summed in float32
            leaf = leaf.astype(jnp.float32)
        groups.setdefault((leaf.shape, leaf.dtype), []).append(jnp.square(leaf))
    total = jnp.zeros((), jnp.float32)
    for (shape, _), squares in groups.items():
        sums = variadic_sums(tuple(squares), tuple(range(len(shape))))
        total = total + sum(s.astype(jnp.float32) for s in sums)
    return jnp.sqrt(total)


def global_norm(tree: Any) -> jax.Array:
    """``optax.tree.norm(tree)`` on the CPU, ``grouped_norm(tree)`` elsewhere."""
    return optax.tree.norm(tree) if jax.default_backend() == "cpu" else grouped_norm(tree)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm(max_norm)`` (the same operations and the same empty state, so
    checkpoints are unchanged) measuring the norm with ``global_norm``."""
    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state
    return optax.GradientTransformation(optax.init_empty_state, update_fn)

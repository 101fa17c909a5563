"""GELU whose backward keeps only its input, as PyTorch's does.

Autodiff of ``jax.nn.gelu`` saves what its derivative reads: for the tanh form the tanh and three
products, for the erf form the erf and an exp, each the size of the MLP's hidden activation
(B, T, mlp_dim), the largest activation of a block. Whichever of them XLA does not recompute in
the backward stays in memory from the forward to the backward (a GPU compiler does not copy a
tanh or erf into a second fusion). Here the backward recomputes them from the saved input: a few
elementwise operations on data the backward reads anyway, and the forward writes only what the
next matmul needs. Values are those of ``jax.nn.gelu`` and its autodiff gradient.

``gelu_bias(z, bias)`` is ``gelu(z + bias)`` keeping ``z``, the matmul's output, which is in memory
anyway: the bias add then happens inside the GELU's kernel, where XLA:GPU otherwise wrote
``z + bias`` out as the saved input beside the GELU's output (models/layers.py, MlpBlock).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """``jax.nn.gelu(x, approximate)``; its backward saves ``x`` alone."""
    return jax.nn.gelu(x, approximate=approximate)


def _gelu_fwd(x: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
    return jax.nn.gelu(x, approximate=approximate), x


def _gelu_bwd(approximate: bool, x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # The barrier hides x's identity from XLA's CSE, which would otherwise merge this tanh (erf)
    # with the forward's and keep it in memory from the forward to here: the very tensor this
    # function exists not to keep (seen in XLA:GPU's buffer assignment, docs/benchmarks.md).
    x = jax.lax.optimization_barrier(x)
    _, vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=approximate), x)
    return vjp(g)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gelu_bias(z: jax.Array, bias: jax.Array, approximate: bool = True) -> jax.Array:
    """``jax.nn.gelu(z + bias, approximate)`` whose backward saves ``z`` and ``bias``: the bias
    add stays inside the GELU's kernel instead of writing ``z + bias`` out for the backward."""
    return jax.nn.gelu(z + bias, approximate=approximate)


def _gelu_bias_fwd(z, bias, approximate):
    return gelu_bias(z, bias, approximate), (z, bias)


def _gelu_bias_bwd(approximate, res, g):
    z, bias = res
    # kept apart from the forward's tanh (``_gelu_bwd``); one barrier, on z alone: a second one
    # on z + bias (calling ``_gelu_bwd``) made XLA:GPU write z + bias out for the backward, 310 MB
    # a B/16 block (benchmarks.gpu_hlo)
    z = jax.lax.optimization_barrier(z)
    _, vjp = jax.vjp(functools.partial(jax.nn.gelu, approximate=approximate), z + bias)
    (dh,) = vjp(g)
    return dh, jnp.sum(dh, axis=tuple(range(dh.ndim - 1)))


gelu_bias.defvjp(_gelu_bias_fwd, _gelu_bias_bwd)

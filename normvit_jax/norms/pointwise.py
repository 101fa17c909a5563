"""Normalization-free point-wise functions in the norm slots: DyT and Derf.

DyT (Zhu et al., CVPR 2025, jiachenzhu/DyT): gamma * tanh(alpha * x) + beta.
Derf (arXiv 2512.10938, zlab-princeton/Derf ViT/dynamic_erf.py): gamma * erf(alpha * x + s) + beta.
alpha (and s) are learnable scalars; gamma/beta (named scale/bias, as LayerNorm's) are per channel.
No statistics: each element is mapped on its own. ``affine=False`` drops gamma/beta: the form
``normvit_jax.reparam`` leaves in a slot after folding gamma/beta into the next Dense.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import channel_params, NormContext


class _PointwiseNorm(nn.Module):
    """gamma * f(x) + beta with f from the subclass; stateless."""

    alpha_init: float = 0.5
    affine: bool = True

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        if not isinstance(opts.get("affine", True), bool):
            raise ValueError(f"norm {ctx.norm!r}: affine={opts['affine']!r} is not accepted; "
                             "accepted: True or False")
        return cls(name=name, **opts)

    def split_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c, kept config options, kept params): output = a * f(x) + c per channel, where f is
        this norm with ``affine=False`` and the kept params (normvit_jax.reparam folds a, c)."""
        if not self.affine:
            return None
        kept = {k: v for k, v in params.items() if k not in ("scale", "bias")}
        return (jnp.asarray(params["scale"]), jnp.asarray(params["bias"]),
                {"affine": False}, kept)

    def pointwise(self) -> tuple[Callable, tuple[jax.Array, ...]]:
        """(f(x float32, params), its scalar params), the params created here."""
        raise NotImplementedError

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        fn, p = self.pointwise()
        scale, bias = channel_params(self, x.shape[-1], self.affine, self.affine)
        if train and jnp.dtype(x.dtype).itemsize < 4:
            return pointwise_affine(x, p, scale, bias, fn)
        if self.affine:  # float32 or inference: as written (and as exported)
            return _affine(x, p, scale, bias, fn)
        return fn(x.astype(jnp.float32), p).astype(x.dtype)


def _affine(x: jax.Array, p: tuple[jax.Array, ...], scale: jax.Array, bias: jax.Array,
            fn: Callable) -> jax.Array:
    return (fn(x.astype(jnp.float32), p) * scale + bias).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pointwise_affine(x: jax.Array, p: tuple[jax.Array, ...], scale: jax.Array, bias: jax.Array,
                     fn: Callable) -> jax.Array:
    """``scale * fn(x as float32, p) + bias`` in x's (half) dtype, whose backward keeps x alone
    and recomputes fn. Autodiff kept fn's float32 output from the forward to the backward for
    the scale's gradient, an activation in float32 a slot (`benchmarks.gpu_hlo`, S/16 bfloat16:
    DyT 9.88 GiB against LayerNorm's 8.09). The recomputation starts behind a barrier with the
    cotangent, so that XLA neither merges it with the forward (CSE) nor moves it there."""
    return _affine(x, p, scale, bias, fn)


def _pointwise_affine_fwd(x, p, scale, bias, fn):
    return _affine(x, p, scale, bias, fn), (x, p, scale, bias)


def _pointwise_affine_bwd(fn, res, g):
    x, p, scale, bias = res
    x, g = jax.lax.optimization_barrier((x, g))
    _, vjp = jax.vjp(lambda *a: _affine(*a, fn), x, p, scale, bias)
    return vjp(g)


pointwise_affine.defvjp(_pointwise_affine_fwd, _pointwise_affine_bwd)


def _tanh(x: jax.Array, p: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.tanh(p[0] * x)


def _erf(x: jax.Array, p: tuple[jax.Array, ...]) -> jax.Array:
    return jax.scipy.special.erf(p[0] * x + p[1])


class DyT(_PointwiseNorm):
    """Dynamic Tanh: gamma * tanh(alpha * x) + beta, alpha init 0.5 (the paper's ViT value)."""

    SPLIT_KEEPS = "tanh(alpha * x)"  # what stays in the slot after reparam folds gamma/beta

    def pointwise(self) -> tuple[Callable, tuple[jax.Array, ...]]:
        alpha = self.param("alpha", nn.initializers.constant(self.alpha_init), (), jnp.float32)
        return _tanh, (alpha,)


class Derf(_PointwiseNorm):
    """Dynamic erf: gamma * erf(alpha * x + s) + beta, alpha init 0.5, shift s init 0."""

    SPLIT_KEEPS = "erf(alpha * x + s)"  # what stays in the slot after reparam folds gamma/beta

    shift_init: float = 0.0

    def pointwise(self) -> tuple[Callable, tuple[jax.Array, ...]]:
        alpha = self.param("alpha", nn.initializers.constant(self.alpha_init), (), jnp.float32)
        s = self.param("shift", nn.initializers.constant(self.shift_init), (), jnp.float32)
        return _erf, (alpha, s)

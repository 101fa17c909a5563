"""Normalization-free point-wise functions in the norm slots: DyT and Derf.

DyT (Zhu et al., CVPR 2025, jiachenzhu/DyT): gamma * tanh(alpha * x) + beta.
Derf (arXiv 2512.10938, zlab-princeton/Derf ViT/dynamic_erf.py): gamma * erf(alpha * x + s) + beta.
alpha (and s) are learnable scalars; gamma/beta (named scale/bias, as LayerNorm's) are per channel.
No statistics: each element is mapped on its own. ``affine=False`` drops gamma/beta: the form
``normvit_jax.reparam`` leaves in a slot after folding gamma/beta into the next Dense.
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import channel_affine, NormContext


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

    def pointwise(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        y = self.pointwise(x.astype(jnp.float32))
        return (channel_affine(self, y) if self.affine else y).astype(x.dtype)


class DyT(_PointwiseNorm):
    """Dynamic Tanh: gamma * tanh(alpha * x) + beta, alpha init 0.5 (the paper's ViT value)."""

    def pointwise(self, x: jax.Array) -> jax.Array:
        alpha = self.param("alpha", nn.initializers.constant(self.alpha_init), (), jnp.float32)
        return jnp.tanh(alpha * x)


class Derf(_PointwiseNorm):
    """Dynamic erf: gamma * erf(alpha * x + s) + beta, alpha init 0.5, shift s init 0."""

    shift_init: float = 0.0

    def pointwise(self, x: jax.Array) -> jax.Array:
        alpha = self.param("alpha", nn.initializers.constant(self.alpha_init), (), jnp.float32)
        s = self.param("shift", nn.initializers.constant(self.shift_init), (), jnp.float32)
        return jax.scipy.special.erf(alpha * x + s)

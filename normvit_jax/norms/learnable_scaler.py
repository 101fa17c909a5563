"""LearnableScaler: no normalization, a per-channel affine y = scale * x + bias."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import NormContext

INITS = ("reference", "ones")


class LearnableScaler(nn.Module):
    """scale_init 'reference': scale ~ N(0, 1) as the released code (``normal_(ones(C))`` draws N(0,1),
    flipping about half the channels' signs); 'ones': scale = 1. bias = 0.

    Named scale/bias like LayerNorm's gamma/beta: LN weights load and act as the same affine
    (without LN's standardisation).
    """

    scale_init: str = "reference"  # not 'init': that would shadow Module.init

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        init = opts.get("scale_init", "reference")
        if init not in INITS:
            raise ValueError(f"norm {ctx.norm!r}: scale_init={init!r} is not accepted; "
                             f"accepted: {list(INITS)}")
        return cls(scale_init=init, name=name)

    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c) with output a * x + c per channel (normvit_jax.reparam folds it)."""
        return jnp.asarray(params["scale"]), jnp.asarray(params["bias"])

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        c = x.shape[-1]
        scale_init = nn.initializers.normal(1.0) if self.scale_init == "reference" else nn.initializers.ones
        scale = self.param("scale", scale_init, (c,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (c,), jnp.float32)
        return (x.astype(jnp.float32) * scale + bias).astype(x.dtype)

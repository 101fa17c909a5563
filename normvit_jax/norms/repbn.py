"""RepBN (SLAB, Guo et al., ICML 2024): BN(x) + eta * x, trains with batch statistics, folds at eval.

Reference: xinghaochen/SLAB classification/models/prepbn.py, a BatchNorm1d on (B, C, T) tokens.
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import NormContext, check_group_size
from normvit_jax.norms.batchnorm import BatchNorm
from normvit_jax.norms.token_channel import TokenMix


class RepBN(nn.Module):
    """y = BN(x) + eta * x, eta one learnable scalar (init 1); BN per channel over all B*T tokens.

    Defaults are the reference's torch BatchNorm1d: momentum 0.1 (Flax's 0.9 here), eps 1e-5,
    normalising with the biased batch variance and storing the unbiased one in the running
    variance. Eval: a * x + c with a = gamma/sqrt(var+eps) + eta, c = beta - gamma*mean/sqrt(var+eps),
    which ``normvit_jax.reparam`` folds into the next Dense. The BN's variables sit under ``bn``.
    """

    TAKES_TOKEN_MIX = True  # __call__(..., token_mix=): the progressive hand-over in one pass

    momentum: float = 0.9
    epsilon: float = 1e-5
    unbiased_running_var: bool = True
    stats_group_size: int | None = None
    eta_init: float = 1.0

    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        check_group_size(ctx.norm, opts.get("stats_group_size"))
        return cls(name=name, **opts)

    @nn.nowrap
    def _bn(self, **where: Any) -> BatchNorm:
        return BatchNorm(momentum=self.momentum, epsilon=self.epsilon,
                         unbiased_running_var=self.unbiased_running_var,
                         stats_group_size=self.stats_group_size, **where)

    @nn.nowrap
    def inference_affine(self, params: Mapping[str, Any], stats: Mapping[str, Any]):
        """(a, c) with eval output a * x + c per channel (normvit_jax.reparam folds it)."""
        a, c = self._bn().inference_affine(params["bn"], stats["bn"])
        return a + jnp.asarray(params["eta"]), c

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False,
                 token_mix: TokenMix | None = None) -> jax.Array:
        """``token_mix``: the progressive hand-over in one pass (BatchNorm.__call__)."""
        eta = self.param("eta", nn.initializers.constant(self.eta_init), (), jnp.float32)
        return self._bn(name="bn")(x, train=train, plus_identity=eta,  # one affine, eta in a
                                   token_mix=token_mix)

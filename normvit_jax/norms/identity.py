"""No normalization: the slot passes tokens through unchanged."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax

from normvit_jax.norms._common import NormContext, check_options


class Identity(nn.Module):
    @classmethod
    def from_config(cls, opts: Mapping[str, Any], ctx: NormContext, name: str | None = None):
        check_options("identity", opts, cls)
        return cls(name=name)

    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        return x

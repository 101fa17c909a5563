"""No normalization: the slot passes tokens through unchanged."""
from __future__ import annotations

import flax.linen as nn
import jax


class Identity(nn.Module):
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        return x

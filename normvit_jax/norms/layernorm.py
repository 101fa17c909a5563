"""LayerNorm over channels, per token (Ba et al. 2016), statistics in float32."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import channel_affine


class LayerNorm(nn.Module):
    """y = scale * (x - mean_C) / sqrt(var_C + eps) + bias, biased variance.

    eps defaults to 1e-6 (Flax/big_vision); the PyTorch references use 1e-5.
    Parameters are named 'scale' and 'bias' as in Google's ViT checkpoints.
    """

    epsilon: float = 1e-6
    use_scale: bool = True
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        return channel_affine(self, y, self.use_scale, self.use_bias).astype(x.dtype)

"""LayerNorm over channels, per token (Ba et al. 2016), statistics in float32."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from normvit_jax.norms._common import PER_TOKEN_STATS, channel_params, variadic_sums


class LayerNorm(nn.Module):
    """y = scale * (x - mean_C) / sqrt(var_C + eps) + bias, biased variance.

    eps defaults to 1e-6 (Flax/big_vision); the PyTorch references use 1e-5.
    Parameters are named 'scale' and 'bias' as in Google's ViT checkpoints.
    ``saved_input`` (None: when the input is half precision): the backward is written out
    (``standardise``) and keeps only the input in its own dtype and two float32 numbers per token,
    as fused LayerNorm kernels do; autodiff of the formula keeps float32 copies of the activation.
    """

    NOT_FOLDED = PER_TOKEN_STATS  # reparam's reason
    TOKEN_DDOF = 0  # a per-token standardiser: the progressive norm's one-pass hand-over takes it

    epsilon: float = 1e-6
    use_scale: bool = True
    use_bias: bool = True
    saved_input: bool | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        scale, bias = channel_params(self, x.shape[-1], self.use_scale, self.use_bias)
        written_out = self.saved_input
        if written_out is None:
            written_out = jnp.dtype(x.dtype).itemsize < 4
        if written_out:
            return standardise(x, scale, bias, self.epsilon, 0)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias).astype(x.dtype)


def _stats(x32: jax.Array, eps: float, ddof: int) -> tuple[jax.Array, jax.Array]:
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.sum(jnp.square(x32 - mean), axis=-1, keepdims=True) / (x32.shape[-1] - ddof)
    return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def standardise(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float,
                ddof: int) -> jax.Array:
    """scale * (x - mean_C) / sqrt(var_C + eps) + bias per token, var = sum of squares / (C - ddof),
    in float32, returned in x's dtype; the backward keeps x and the per-token mean and 1/std."""
    return _standardise_fwd(x, scale, bias, eps, ddof)[0]


def _standardise_fwd(x, scale, bias, eps, ddof):
    x32 = x.astype(jnp.float32)
    mean, rstd = _stats(x32, eps, ddof)
    return ((x32 - mean) * rstd * scale + bias).astype(x.dtype), (x, scale, mean, rstd)


def _standardise_bwd(eps, ddof, res, dy):
    x, scale, mean, rstd = res
    # Behind a barrier, the saved statistics are used as they are: XLA:GPU otherwise recomputed
    # them from x inside a row-reduction fusion, which then wrote dy * xhat out in float32 for
    # the parameters' sums to read back (B/16: 854 -> 467 MB a slot's backward; the step's
    # memory-bound traffic -10%, docs/benchmarks.md).
    x, mean, rstd, dy = jax.lax.optimization_barrier((x, mean, rstd, dy))
    dy = dy.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    u = dy * scale
    c = x.shape[-1]
    dx = rstd * (u - jnp.mean(u, axis=-1, keepdims=True)
                 - xhat * jnp.sum(u * xhat, axis=-1, keepdims=True) / (c - ddof))
    dscale, dbias = variadic_sums((dy * xhat, dy), tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale, dbias


standardise.defvjp(_standardise_fwd, _standardise_bwd)

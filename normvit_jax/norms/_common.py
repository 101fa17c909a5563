"""What the normalizers share: their context, option checks, float32 statistics, ghost groups.

The norm files import this module, never the registry (which imports them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp


# reparam's reason for keeping a slot whose norm standardises each token by its own statistics
PER_TOKEN_STATS = "statistics of each token at inference, not a fixed affine"


@dataclasses.dataclass(frozen=True)
class NormContext:
    """What a norm may need to know about where it sits.

    dim: channels C. num_heads: attention heads H of the model. grid: (rows, cols) of the patch
    grid, or None where tokens have no grid. num_prefix_tokens: leading non-patch tokens (the class
    token) in the sequence this norm sees. slot: the slot name and norm: the registry name the
    config chose, both for error messages.
    """

    dim: int
    num_heads: int = 1
    grid: tuple[int, int] | None = None
    num_prefix_tokens: int = 0
    slot: str = ""
    norm: str = ""


def accepted_options(cls: type) -> set[str]:
    """The config options of a norm class: its dataclass fields, less Flax's own (parent, name)
    and those filled from the NormContext (the class's ``CONTEXT_FIELDS``)."""
    return ({f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
            - set(getattr(cls, "CONTEXT_FIELDS", ())))


def check_options(norm_name: str, opts: Mapping[str, Any], cls: type) -> None:
    """Raises a ValueError naming unknown options of a norm and the accepted ones."""
    accepted = accepted_options(cls)
    unknown = sorted(set(opts) - accepted)
    if unknown:
        raise ValueError(
            f"Unknown option(s) {unknown} for norm {norm_name!r}; accepted: {sorted(accepted)}")


def as_groups(x: jax.Array, group_size: int | None, norm_name: str) -> jax.Array:
    """(B, T, C) -> (G, B/G, T, C) in float32: G ghost groups of ``group_size`` samples, whose
    statistics are reduced over axes (1, 2). Samples and tokens stay two axes: with XLA:CPU's
    default flags (main.py's) a reduction over one flattened (1, B*T, C) axis is ~10x slower per
    layer, and a (B*T, C) array is still slow for BatchNorm; with the benchmarks' tuned flags
    (YNNPACK off) the flattened form is ~2x faster instead (benchmarks/norm_kernels.py,
    docs/norms.md). main.py's flags decide.

    ``group_size`` None gives one group over the whole (possibly sharded) batch: under a sharded
    jit a mean over the group's axes is then the global, synchronised statistic.
    """
    b, t, c = x.shape
    g = ghost_groups(b, group_size, norm_name)
    return x.astype(jnp.float32).reshape(g, b // g, t, c)


def ghost_groups(b: int, group_size: int | None, norm_name: str) -> int:
    """How many ghost groups of ``group_size`` samples a batch of ``b`` makes (as_groups)."""
    if group_size is not None and group_size < b and b % group_size:
        raise ValueError(f"norm {norm_name!r}: stats_group_size={group_size} does not divide the "
                         f"batch size {b}; accepted: a divisor of the batch size, or None")
    return 1 if group_size is None or group_size >= b else b // group_size


def check_group_size(norm_name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"norm {norm_name!r}: stats_group_size={value!r} is not accepted; "
                         "accepted: None (global batch statistics) or a positive integer")


def resolve_groups(norm_name: str, key: str, value: Any, dim: int, num_heads: int) -> int:
    """Groups of channels: an int, or 'heads'/None for the model's number of heads."""
    groups = num_heads if value in (None, "heads") else value
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or dim % groups:
        shown = "'heads'" if value is None else repr(value)
        raise ValueError(f"norm {norm_name!r}: {key}={shown} ({groups} groups) does not divide the "
                         f"width {dim}; accepted: 'heads' or a positive divisor of {dim}")
    return groups


def group_rms_scale(x: jax.Array, groups: int, eps: float) -> jax.Array:
    """Per token and channel group: x / sqrt(mean_group(x^2) + eps) (PowerNorm's and DTN's first step)."""
    shape = x.shape
    xg = x.reshape(shape[:-1] + (groups, shape[-1] // groups))
    xg = xg * jax.lax.rsqrt(jnp.mean(jnp.square(xg), axis=-1, keepdims=True) + eps)
    return xg.reshape(shape)


def updating(module: Any, train: bool) -> bool:
    """Whether a stateful norm advances its state now: training, and not while initialising."""
    return train and not module.is_initializing()


def channel_params(module: Any, c: int, scale: bool = True,
                   bias: bool = True) -> tuple[jax.Array, jax.Array]:
    """Per-channel float32 parameters 'scale' (ones) and 'bias' (zeros) created in ``module``
    (from its compact ``__call__``); one left out is the constant 1 or 0 (XLA drops the op)."""
    s = (module.param("scale", nn.initializers.ones, (c,), jnp.float32) if scale
         else jnp.ones((c,), jnp.float32))
    b = (module.param("bias", nn.initializers.zeros, (c,), jnp.float32) if bias
         else jnp.zeros((c,), jnp.float32))
    return s, b


def channel_affine(module: Any, y: jax.Array, scale: bool = True, bias: bool = True) -> jax.Array:
    """y * scale + bias with ``channel_params``; the part that folds. Either can be left out
    (LayerNorm's and RMSNorm's ``use_scale``/``use_bias``)."""
    s, b = channel_params(module, y.shape[-1], scale, bias)
    return y * s + b


def variadic_sums(arrays: tuple[jax.Array, ...], axes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Sums of same-shaped arrays over ``axes`` as one variadic reduce: one kernel that reads what
    they are computed from once. Separate sums were a kernel each on XLA:GPU, and a product that
    two of them shared was written out in float32 and read back (docs/benchmarks.md)."""
    return jax.lax.reduce(arrays, tuple(jnp.zeros((), a.dtype) for a in arrays),
                          lambda u, v: tuple(a + b for a, b in zip(u, v)), axes)

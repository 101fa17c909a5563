"""FLOPs per image of a ViT's eval forward.

``xla_flops``: XLA's cost analysis of the compiled eval forward (batch 1, float32, on the CPU
backend so every op is counted: an accelerator's fused attention kernel would be opaque to it). It
counts every op: a multiply-add is 2 FLOPs, and norms, softmax and GELU add their elementwise work.
``analytic_flops``: 2 x the multiply-adds of the matmuls (patch embedding or stem, q/k/v/out, attention
logits and weighted sum, MLP, head); norms, softmax, GELU and biases are left out. Many papers quote
multiply-adds as "FLOPs": that is ``analytic_flops / 2``.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from normvit_jax.analysis import capture


_CACHE: dict[str, float] = {}


def xla_flops_of_config(config: ml_collections.ConfigDict, data_spec: Any, variables: Any) -> float:
    """``xla_flops`` of the model built from a run's config and DataSpec (compiled once per model
    config)."""
    key = capture.config_key(config, data_spec)
    if key not in _CACHE:
        _CACHE[key] = xla_flops(capture.build_model(config, data_spec), variables,
                                int(data_spec.image_shape[0]))
    return _CACHE[key]


def xla_flops(model: Any, variables: Any, image_size: int) -> float:
    """FLOPs of one image's eval forward from XLA's cost analysis (CPU backend)."""
    cpu = jax.devices("cpu")[0]
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(cpu))
    abstract = jax.tree.map(spec, variables)
    image = spec(jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32))
    compiled = jax.jit(lambda v, x: model.apply(v, x, train=False)).lower(abstract, image).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost["flops"])


def analytic_flops(spec: Any, image_size: int) -> float:
    """2 x multiply-adds of the matmuls of one image's forward (see the module docstring) of a
    ``ViTSpec`` with ``num_classes``."""
    d, mlp = spec.hidden_size, spec.mlp_dim
    grid, _ = capture.geometry(spec, image_size)
    n = grid[0] * grid[1]
    macs = spec.stem_macs(image_size)  # patch embedding (T2T-ViT: its Performer stem)
    for has_cls in spec.block_has_cls():
        t = n + int(has_cls)
        macs += 4 * t * d * d  # query, key, value, out
        macs += 2 * t * t * d  # logits q.k and the weighted sum of values, all heads
        macs += 2 * t * d * mlp  # MLP
    rep = spec.representation_size or 0
    macs += d * rep + (rep or d) * spec.num_classes
    return 2.0 * macs

"""Mean attention distance (Dosovitskiy et al. 2021, Fig. 7): the image-space distance between a
query patch and the key patches, weighted by the attention.

Distances are between patch centres in input pixels. Only patch-to-patch attention counts: prefix
(class) tokens are left out as queries and as keys, and each query's weights over the patch keys
are renormalised to sum to 1, so uniform attention gives the grid's mean pairwise distance whatever
the number of prefix tokens. Per image and head: the mean over query patches.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np


def patch_centres(grid: tuple[int, int], patch_size: int) -> np.ndarray:
    """(N, 2) pixel coordinates (row, col) of the patch centres, patches row-major."""
    rows, cols = np.divmod(np.arange(grid[0] * grid[1]), grid[1])
    return (np.stack([rows, cols], -1).astype(np.float64) + 0.5) * patch_size


def distance_matrix(grid: tuple[int, int], patch_size: int) -> np.ndarray:
    """(N, N) Euclidean pixel distance between patch centres."""
    c = patch_centres(grid, patch_size)
    return np.sqrt(np.sum(np.square(c[:, None] - c[None]), -1))


def uniform_distance(grid: tuple[int, int], patch_size: int) -> float:
    """The mean attention distance of uniform attention: the grid's mean pairwise distance."""
    return float(distance_matrix(grid, patch_size).mean())


def mean_attention_distance(attention: Any, grid: tuple[int, int], patch_size: int) -> Any:
    """(B, H) mean distance in pixels of attention weights (B, H, T, T), T = prefix + N patches.

    Works on numpy and jax arrays (jnp ops, float32).
    """
    n = grid[0] * grid[1]
    prefix = attention.shape[-1] - n
    if prefix < 0 or attention.shape[-2] != attention.shape[-1]:
        raise ValueError(f"attention of shape {attention.shape} does not fit a {grid} patch grid")
    w = jnp.asarray(attention, jnp.float32)[..., prefix:, prefix:]
    w = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-12)
    d = jnp.asarray(distance_matrix(grid, patch_size), jnp.float32)
    return jnp.mean(jnp.sum(w * d, -1), -1)

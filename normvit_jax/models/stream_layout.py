"""``model.stream_layout``: the residual stream's memory layout, pinned row-major on GPU.

XLA:GPU lays the (batch, tokens, channels) residual stream out as it likes wherever no matmul
reads it directly, and with a norm between the stream and every matmul it chose the batch
innermost (physically tokens, channels, batch): every residual add and every norm's input and
output then became a transposing kernel, forward and backward (docs/benchmarks.md, "What XLA:GPU
compiles, read on a CPU"). A layout constraint on the stream at each block's input, after its
first residual add and at its output keeps it (batch, tokens, channels) row-major, the layout
the matmuls read; values and gradients are the same, only the kernels change.
"""
from __future__ import annotations

import jax
from jax.experimental.layout import Layout, with_layout_constraint

STREAM_LAYOUTS = ("auto", "row_major", "free")


def pinned(setting: str) -> bool:
    """'auto': pinned when compiling for GPU (where it was measured: `benchmarks.gpu_hlo`),
    'row_major' always, 'free' never (XLA chooses)."""
    return setting == "row_major" or (setting == "auto" and jax.default_backend() == "gpu")


def pin(x: jax.Array, setting: str) -> jax.Array:
    """``x`` with its layout constrained to row-major (major to minor: its axes in order) where
    ``setting`` pins it; ``x`` unchanged otherwise."""
    if not pinned(setting):
        return x
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))

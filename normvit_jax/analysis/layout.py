"""Variable-tree layout: a scanned encoder (``model.scan``) keeps its leading blocks under one
``Transformer/encoderblock`` scope with every leaf stacked on axis 0; analysis works per block."""
from __future__ import annotations

from typing import Any, Mapping

import jax

SCANNED = "encoderblock"


def unstack_blocks(tree: Any) -> Any:
    """The tree with each scanned ``encoderblock`` subtree split into ``encoderblock_{i}``."""
    if not isinstance(tree, Mapping):
        return tree
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == SCANNED and isinstance(value, Mapping):
            leaves = jax.tree.leaves(value)
            for i in range(leaves[0].shape[0] if leaves else 0):
                out[f"{SCANNED}_{i}"] = jax.tree.map(lambda a, i=i: a[i], value)
        else:
            out[key] = unstack_blocks(value)
    return out

"""Layer-wise learning-rate decay for fine-tuning (BEiT, MAE, timm's ``layer_decay``).

Layer ids: the embeddings (patch embedding and its norms, T2T-ViT's tokens-to-token stem, class
token, position embedding) are layer 0, block i is layer i + 1, everything after the blocks (final
norm, pre_logits, head) is layer depth + 1. The lr scale of layer l is ``decay ** (depth + 1 - l)``. The scale multiplies the final
updates, which equals scaling the param group's lr in timm (weight decay included, as torch's
AdamW multiplies it by the lr). A scanned model (``Transformer/encoderblock`` stacked along axis 0)
gets one scale per slice of that axis.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import optax

from normvit_jax.models import t2t_vit

# the stems: ViT's patch embedding, T2T-ViT's tokens-to-token module (BEiT's patch_embed: layer 0)
_EMBEDDING = ("embedding", t2t_vit.STEM_SCOPE, "cls", "posembed_input", "patch_norm_pre",
              "patch_norm_post")
_BLOCK = re.compile(r"encoderblock_(\d+)$")


def _names(path: tuple) -> list[str]:
    return [jax.tree_util.keystr((k,), simple=True) for k in path]


def depth_of(params: Any) -> int:
    """Number of blocks: unrolled ``encoderblock_<i>`` and the length of a scanned stack."""
    depth = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        for name in _names(path):
            m = _BLOCK.match(name)
            if m:
                depth = max(depth, int(m.group(1)) + 1)
            elif name == "encoderblock":
                depth = max(depth, int(leaf.shape[0]))
    return depth


def layer_ids(params: Any) -> Any:
    """Per leaf: an int layer id, or for scanned leaves an int array (k,) of ids 1..k."""
    depth = depth_of(params)

    def one(path, leaf):
        names = _names(path)
        for name in names:
            m = _BLOCK.match(name)
            if m:
                return int(m.group(1)) + 1
            if name == "encoderblock":
                return np.arange(1, leaf.shape[0] + 1)
        if names[0] in _EMBEDDING or (names[0] == "Transformer" and names[1] in _EMBEDDING):
            return 0
        return depth + 1

    return jax.tree_util.tree_map_with_path(one, params)


def scales(params: Any, decay: float) -> Any:
    """Per leaf: a float, or for scanned leaves an array broadcastable against the leaf."""
    depth = depth_of(params)

    def one(lid, leaf):
        s = np.asarray(decay, np.float64) ** (depth + 1 - np.asarray(lid))
        return s.reshape(s.shape + (1,) * (leaf.ndim - s.ndim)).astype(np.float32) if s.ndim else float(s)

    return jax.tree.map(one, layer_ids(params), params)


def scale_by_layer(decay: float) -> optax.GradientTransformation:
    """Stateless: multiplies each update by its layer's scale (place after the lr)."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"config.layer_decay={decay} must be in (0, 1] (1: off)")

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        s = scales(updates, decay)  # from the tree's names and shapes only: static under jit
        return jax.tree.map(lambda u, k: u * k, updates, s), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)

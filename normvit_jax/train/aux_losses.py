"""LearnableScaler's extra training losses: feature decay and the attention loss.

Source: nghiemtuan/LearnableScaler @1750860, ``timm/models/vision_transformer.py`` (Block.forward
:236-263, Block.compute_feature_decay_loss :229-234, Attention.compute_extra_loss :85-91, computed
before attention dropout :127-129) and ``train.py`` (:363-365 flags, :465-473, :950-958). With
fd = ``feature_decay`` and a = ``attn_extra_loss`` the training loss is

    CE + fd * (fd * sum_blocks [F(x_attn) + F(x_mlp)] + a * sum_{block < attn_extra_loss_layers} A)

fd appears twice on purpose: each block adds ``F * fd`` and train.py:954 multiplies the sum by fd
again. F(x) = mean(d) + max(d) over d = |x| - threshold of the entries with |x| > threshold (0 if
none), x the residual stream after the attention (x_attn) and after the MLP (x_mlp) residual add.
A = 1 - mean(m < 0.5) over m, each (image, head, query)'s largest attention probability (0 if
none is < 0.5). The attention term only exists with feature decay on (Block.forward returns
before it otherwise); config_ranges refuses it alone. Reductions run over the micro-batch the model
sees (the reference: its per-GPU loader batch).

The model sows what the losses read (models/vit.py) when their collection is mutable, which only
the train step with these losses on asks for; otherwise nothing is sown or computed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from normvit_jax import config_ranges
from normvit_jax.models.layers import ATTENTION_MAX, RESIDUAL

ATTENTION_THRESHOLD = 0.5  # vision_transformer.py:87, hard-coded there


def feature_penalty(x: jax.Array, threshold: float) -> jax.Array:
    """F(x): mean + max of |x| - threshold over the entries above the threshold; 0 if none."""
    a = jnp.abs(x.astype(jnp.float32))
    above = a > threshold
    d = jnp.where(above, a - threshold, 0.0)  # entries below get neither value nor gradient
    n = jnp.sum(above)
    return jnp.where(n > 0, jnp.sum(d) / jnp.maximum(n, 1) + jnp.max(d), 0.0)


def attention_penalty(attention_max: jax.Array) -> jax.Array:
    """A(m): 1 - mean of the maxima m below 0.5; 0 if none is."""
    m = attention_max.astype(jnp.float32)
    low = m < ATTENTION_THRESHOLD
    n = jnp.sum(low)
    return jnp.where(n > 0, 1.0 - jnp.sum(jnp.where(low, m, 0.0)) / jnp.maximum(n, 1), 0.0)


def _blocks_in_order(tree: Any, name: str) -> list[jax.Array]:
    """The values sown as ``name``, one per encoder block in block order. Scanned blocks
    ('encoderblock', stacked on axis 0) come first; then 'encoderblock_<i>' by i."""
    found: list[tuple[int, jax.Array]] = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(p, "key", None) for p in path]
        if name not in keys:
            continue
        block = next((k for k in keys if isinstance(k, str) and k.startswith("encoderblock")), None)
        if block is None:
            raise ValueError(f"'{name}' sown outside an encoder block: {jax.tree_util.keystr(path)}")
        if block == "encoderblock":
            found.extend((i, leaf[i]) for i in range(leaf.shape[0]))
        else:
            found.append((int(re.fullmatch(r"encoderblock_(\d+)", block).group(1)), leaf))
    return [v for _, v in sorted(found, key=lambda t: t[0])]


@dataclasses.dataclass(frozen=True)
class ExtraLoss:
    """The config's extra losses (``feature_decay``, ``feature_decay_threshold``,
    ``attn_extra_loss``, ``attn_extra_loss_layers``; configs/default.py)."""
    feature_decay: float
    threshold: float = 200.0
    attn_extra_loss: float = 0.0
    attn_layers: int = 0

    @classmethod
    def from_config(cls, config: Any) -> "ExtraLoss | None":
        """None when feature decay is off (the default): the train step is then unchanged."""
        config_ranges.check_extra_losses(config)
        if not config.feature_decay:
            return None
        return cls(float(config.feature_decay), float(config.feature_decay_threshold),
                   float(config.attn_extra_loss), int(config.attn_extra_loss_layers))

    @property
    def collections(self) -> list[str]:
        """The collections the model must make mutable (sow into) for this loss."""
        with_attention = self.attn_extra_loss > 0 and self.attn_layers > 0
        return [RESIDUAL] + ([ATTENTION_MAX] if with_attention else [])

    def __call__(self, mutated: Any) -> jax.Array:
        """The extra loss from the model's mutated collections of one forward pass."""
        streams = _blocks_in_order(mutated.get(RESIDUAL, {}), "after_attention") + \
            _blocks_in_order(mutated.get(RESIDUAL, {}), "after_mlp")
        if not streams:
            raise ValueError("feature_decay is on but the model sowed no residual stream "
                             f"('{RESIDUAL}'); only models/vit.py's encoder blocks do")
        features = sum(feature_penalty(x, self.threshold) for x in streams)
        total = self.feature_decay * features
        if ATTENTION_MAX in self.collections:
            maxima = _blocks_in_order(mutated.get(ATTENTION_MAX, {}), "max")[: self.attn_layers]
            total = total + self.attn_extra_loss * sum(attention_penalty(m) for m in maxima)
        return self.feature_decay * total


"""Analytic FLOPs of a ViT train step, device peaks, and MFU.

Why not XLA's count: XLA:GPU's cost analysis leaves out the matmuls it hands to cuBLAS/cuDNN
custom calls (ViT-B/16 at batch 256 in bfloat16: ~1.23 TFLOP reported for a step that does
~27), so MFU from it was off by 20x on GPU. On CPU XLA's count agrees with this one to a few
percent (it adds the elementwise work and the optimizer), and the train-step benchmark prints both.

Conventions (docs/benchmarks.md, "How FLOPs are counted"):
- a multiply-add is 2 FLOPs; only matrix products are counted: the patch embedding (a
  (P*P*3) x D product per patch), per block the fused QKV projection, the attention scores
  Q K^T, the weighted sum A V, the output projection and the two MLP layers, then the
  pre-logits layer if any and the head (on the class token or the pooled tokens);
  norms, softmax, GELU, residuals, the loss and the optimizer update are not counted;
- a train step is 3x the forward (the backward is two products per forward product); activation
  recomputation (remat) is not counted, so MFU measures useful work;
- DTN's position-aware statistics are matrix products too; ``dtn_statistics_flops`` adds them for
  the flop ratio of DTN against LayerNorm (not for the ViT's own MFU figure).
"""
from __future__ import annotations

import dataclasses
from typing import Any

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets, per compute dtype. 'float32' is
# TF32 tensor-core math, which XLA uses for float32 dots on Ampere and later at its default
# precision. Keys are matched as substrings of jax's device_kind, most specific first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    "H100 NVL": {"bfloat16": 835.0, "float16": 835.0, "float32": 417.5},
    "H200 NVL": {"bfloat16": 835.0, "float16": 835.0, "float32": 417.5},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},  # SXM ('H100 80GB HBM3')
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
}


@dataclasses.dataclass(frozen=True)
class VitShape:
    """What the FLOP count depends on."""

    hidden: int
    depth: int
    heads: int
    mlp_dim: int
    patch: int
    image_size: int
    num_classes: int
    channels: int = 3
    class_token: bool = True
    cls_token_at_block: int = 0  # the class token joins before this block (0: from the start)
    representation_size: int | None = None

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    def tokens(self, block: int) -> int:
        return self.patches + int(self.class_token and block >= self.cls_token_at_block)


def shape_from_spec(spec: Any, image_size: int, num_classes: int) -> VitShape:
    """From a model spec (``models.spec_of``)."""
    return VitShape(hidden=spec.hidden_size, depth=spec.depth, heads=spec.num_heads,
                    mlp_dim=spec.mlp_dim, patch=spec.patch_size, image_size=int(image_size),
                    num_classes=int(num_classes), class_token=spec.uses_cls,
                    cls_token_at_block=int(spec.cls_token_at_block or 0),
                    representation_size=spec.representation_size or None)


def forward_flops(s: VitShape) -> dict[str, float]:
    """Forward FLOPs of one image, per part."""
    d = s.hidden
    parts = {"patch_embed": 2.0 * s.patches * s.patch * s.patch * s.channels * d,
             "qkv": 0.0, "scores": 0.0, "attn_v": 0.0, "proj": 0.0, "mlp": 0.0}
    for i in range(s.depth):
        t = s.tokens(i)
        parts["qkv"] += 2.0 * t * d * 3 * d
        parts["scores"] += 2.0 * t * t * d  # all heads: H * T * T * (D/H) multiply-adds
        parts["attn_v"] += 2.0 * t * t * d
        parts["proj"] += 2.0 * t * d * d
        parts["mlp"] += 2.0 * 2 * t * d * s.mlp_dim
    width = d
    if s.representation_size:
        parts["pre_logits"] = 2.0 * d * s.representation_size
        width = s.representation_size
    parts["head"] = 2.0 * width * s.num_classes
    return parts


def train_step_flops(s: VitShape, batch: int, extra_forward_per_image: float = 0.0) -> float:
    """Model FLOPs of one train step on ``batch`` images: 3x the forward."""
    return 3.0 * batch * (sum(forward_flops(s).values()) + extra_forward_per_image)


def dtn_statistics_flops(s: VitShape, slots: int, stat_tokens: int | None = None) -> float:
    """Forward FLOPs per image of DTN's position-aware moments in ``slots`` norm slots: the first
    and second moments of every channel mixed by a (N, N) matrix per head, N the patch tokens (or
    the pooled statistics grid): 2 moments x 2 x N^2 x C."""
    n = stat_tokens or s.patches
    return float(slots) * 2 * 2.0 * n * n * s.hidden


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """The datasheet peak for this device and compute dtype, or None when not in the table."""
    for key, by_dtype in PEAK_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return by_dtype.get(dtype)
    return None


def mfu(flops: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak FLOP/s."""
    return flops / step_s / peak_flops

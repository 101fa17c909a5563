"""timm's VisionTransformer state dict (DeiT, timm, HF hub ``.safetensors``) as vit_jax names.

``canonicalize`` renames and reshapes a timm state dict into the names and shapes
``google_layout.canonicalize`` produces for Google's files, so ``pretrained.init_from_npz`` loads
both through one path (position-embedding resampling, head rules, strict LN, report, errors).
It is the inverse of timm's ``_load_weights`` (vision_transformer.py): torch Linear weights are
(out, in) and transposed; the conv is OIHW -> HWIO; the fused qkv splits into q, k, v with heads
flattened ((D, H*Dh): the loader reshapes them to the model's heads, which a timm file does not
record). Features this ViT lacks are refused by name, never dropped. The norm modules of the
methods' original code (SLAB's RepBN and LinearNorm, DyT, Derf, DTN, LearnableScaler, PowerNorm)
are renamed to this project's norm parameters first (``original_norms``).
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import numpy as np

from normvit_jax.models import original_norms
from normvit_jax.models import spec as spec_lib
from normvit_jax.models.google_layout import POSEMB, CheckpointError, Layout

# The file's norm slots: Google's, and timm's fc_norm (global_pool='avg': classifier
# 'token_gap_fc_norm' with cls_token, 'gap_fc_norm' without; pretrained.file_classifier).
NORM_SLOTS = spec_lib.GOOGLE_SLOTS | {spec_lib.FC_SLOT}
# (a timm key pattern, the feature) this ViT has no layer for.
REFUSED = (
    (r"\.ls[12]\.gamma$|\.gamma_[12]$", "LayerScale (ls1/ls2 gamma: DeiT III, CaiT-style blocks)"),
    (r"^dist_token$|^head_dist\.", "a distillation token (dist_token, head_dist: DeiT distilled)"),
    (r"^reg_token$", "register tokens (reg_token)"),
    (r"\.attn\.(q_norm|k_norm)\.", "qk-norm (attn.q_norm/k_norm)"),
    (r"^attn_pool\.", "an attention-pooling head (attn_pool: global_pool='map')"),
    (r"^norm_pre\.", "a norm before the blocks (norm_pre: pre_norm=True, CLIP)"),
    (r"^patch_embed\.norm\.", "a norm in the patch embedding (patch_embed.norm)"),
    (r"\.attn\.norm\.|\.mlp\.norm\.", "a norm inside attention or MLP (scale_attn/mlp_norm)"),
)
# (a key prefix, the original code whose names these are) of other ViT layouts the methods' code
# writes: named in the refusal instead of "not a timm state dict".
FOREIGN = (
    ("to_patch_embedding.", "the DTN repository's models/vit_norm.py (lucidrains-style names: "
     "to_patch_embedding, transformer.layers, mlp_head; with DTN it cannot run, DTN asserts the 196 "
     "patch tokens and that ViT passes the class token too); its models/vit_norm_mix.py, timm's "
     "names, loads"),
    ("transformer.embeddings.", "RescaleViT / jeonsworld ViT-pytorch (transformer.embeddings, "
     "transformer.encoder.layer): another layout, not mapped"),
    ("tokens_to_token.", "a T2T-ViT (UN's image_classification/models/t2t_vit.py): init_from "
     "loads the ViT family only"),
)
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
# per-block module -> (vit_jax module, transpose the weight)
_BLOCK_MODULES = {
    "norm1": ("LayerNorm_0", False), "norm2": ("LayerNorm_2", False),
    "attn.proj": ("MultiHeadDotProductAttention_1/out", True),
    "mlp.fc1": ("MlpBlock_3/Dense_0", True), "mlp.fc2": ("MlpBlock_3/Dense_1", True),
}
_TOP_MODULES = {"norm": ("Transformer/encoder_norm", False), "fc_norm": ("fc_norm", False),
                "head": ("head", True), "pre_logits.fc": ("pre_logits", True)}  # timm < 0.6


def refuse(sd: Mapping[str, np.ndarray], patterns: Sequence[tuple[str, str]]) -> None:
    """CheckpointError naming every (pattern, feature) the keys show and the first key of each:
    features this ViT has no layer for are refused by name, never dropped."""
    refused = {}
    for pattern, what in patterns:
        hits = sorted(k for k in sd if re.search(pattern, k))
        if hits:
            refused[what] = hits[0] + (f" and {len(hits) - 1} more" if len(hits) > 1 else "")
    if refused:
        raise CheckpointError("the checkpoint has what this model lacks: " + "; ".join(
            f"{what} [{k}]" for what, k in refused.items()))


def looks_like_timm(keys: Sequence[str]) -> bool:
    return any(k.startswith(("patch_embed.", "blocks.", "cls_token", "pos_embed")) for k in keys)


def canonicalize(sd: Mapping[str, np.ndarray], source_grid: Sequence[int] | None = None
                 ) -> tuple[dict[str, np.ndarray], Layout]:
    """vit_jax-named arrays of a timm VisionTransformer state dict, and its ``Layout``. Keys it
    does not know keep their name (the loader reports them as unexpected)."""
    foreign = next((what for prefix, what in FOREIGN if any(k.startswith(prefix) for k in sd)), None)
    if foreign:
        raise CheckpointError(f"not a timm VisionTransformer state dict: {foreign}")
    if "patch_embed.proj.weight" not in sd:
        under = next((k[:-len("patch_embed.proj.weight")] for k in sd
                      if k.endswith(".patch_embed.proj.weight")), None)
        google = next((k for k in sd if k.endswith("embedding/kernel")), None)
        hint = (f"; its ViT keys are under {under!r} (an EMA copy or a wrapper's prefix): strip it "
                f"and save again, {{k[{len(under)}:]: v for k, v in sd.items() if "
                f"k.startswith({under!r})}}" if under else
                f"; its keys are Google's ViT names ({google}): save them as an .npz "
                "(np.savez) to load them as Google's layouts" if google else
                f"; first keys: {sorted(sd)[:6]}")
        raise CheckpointError("no 'patch_embed.proj.weight': not a timm (or HF transformers) "
                              f"VisionTransformer state dict{hint}")
    refuse(sd, REFUSED)
    sd, renamed = original_norms.rename(sd)
    src: dict[str, np.ndarray] = {}
    notes: dict[str, str] = {}
    for k, v in sd.items():
        m = _BLOCK.match(k)
        if m:
            name = _block(src, f"Transformer/encoderblock_{m.group(1)}/", m.group(2), v, k)
            if k in renamed:
                notes[name] = renamed[k]
        elif k == "patch_embed.proj.weight":
            if v.ndim != 4:
                raise CheckpointError(f"patch_embed.proj.weight {v.shape} is not a (D, C, P, P) conv")
            src["embedding/kernel"] = v.transpose(2, 3, 1, 0)
        elif k == "patch_embed.proj.bias":
            src["embedding/bias"] = v
        elif k == "cls_token":
            src["cls"] = v
        elif k == "pos_embed":
            src[POSEMB] = v
        else:
            name = _module(src, "", k, v, _TOP_MODULES, k)
            if k in renamed:
                notes[name] = renamed[k]
    slot = _class_slot(sd, source_grid)
    return src, Layout("", False, "timm", "pos_embed" if "pos_embed" in sd else None, slot, (),
                       NORM_SLOTS, notes)


def _block(src: dict[str, np.ndarray], prefix: str, rest: str, v: np.ndarray, key: str) -> str:
    if rest in ("attn.qkv.weight", "attn.qkv.bias"):
        if v.shape[0] % 3:
            raise CheckpointError(f"{prefix}{rest} {v.shape}: the fused qkv is not 3 equal parts")
        what = "kernel" if rest.endswith("weight") else "bias"
        for name, part in zip(("query", "key", "value"), np.split(v, 3, axis=0)):
            src[f"{prefix}MultiHeadDotProductAttention_1/{name}/{what}"] = part.T if part.ndim == 2 else part
        return key
    return _module(src, prefix, rest, v, _BLOCK_MODULES, key)


def _module(src: dict[str, np.ndarray], prefix: str, key: str, v: np.ndarray,
            table: Mapping[str, tuple[str, bool]], original: str) -> str:
    """``module.param`` through ``table``: a Linear's weight -> kernel (transposed), bias; inside a
    norm, ``weight`` -> ``scale`` and other tensors keep their path ('bn.running_mean' ->
    'bn/running_mean': a BatchNorm's statistics, RepBN's inner BatchNorm). Returns the name."""
    module = next((m for m in table if key.startswith(m + ".")), None)
    if module is None:
        src[original] = v  # unknown: the loader reports it as unexpected
        return original
    name, linear = table[module]
    path = key[len(module) + 1:].split(".")
    if linear and path not in (["weight"], ["bias"]):
        src[original] = v
        return original
    if path[-1] == "weight":
        path[-1], v = ("kernel", v.T) if linear else ("scale", v)
    name = f"{prefix}{name}/{'/'.join(path)}"
    src[name] = v
    return name


def _class_slot(sd: Mapping[str, np.ndarray], source_grid: Sequence[int] | None) -> bool:
    """Whether pos_embed has a slot for the class token. A timm file does not say
    (``no_embed_class``): the token count does, as timm's own loader assumes."""
    pe = sd.get("pos_embed")
    if "cls_token" not in sd or pe is None or pe.ndim != 3:
        return False
    n = pe.shape[1]
    if source_grid is not None:
        return n == int(source_grid[0]) * int(source_grid[1]) + 1
    if math.isqrt(n) ** 2 == n and math.isqrt(n - 1) ** 2 != n - 1:
        return False  # a square grid alone: no_embed_class
    return True  # timm's default, also for a non-square grid (then named: init_source_grid)

"""Hugging Face transformers' ViT state dict (``ViTForImageClassification`` / ``ViTModel``:
google/vit-*, facebook/deit-*-patch16-224) renamed to timm's names, then to vit_jax's by
``timm_layout.canonicalize``: one path for both PyTorch layouts.

Two spellings exist: what ``save_pretrained`` writes and every hub file holds
(``encoder.layer.{i}.attention.attention.query``, ``intermediate.dense``, ``output.dense``), and
``model.state_dict()`` of transformers >= 5 (``layers.{i}.attention.q_proj``, ``mlp.fc1``). The
prefix is ``vit.`` (ViTForImageClassification) or none (ViTModel). HF stores q, k and v apart;
they are concatenated into timm's fused qkv (exact). HF's ViT computes what timm's does (pre-norm
blocks, exact GELU, class token with a posemb slot) except LayerNorm's epsilon (1e-12), which the
model's norm config sets (docs/pretrained.md).
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

import numpy as np
from etils import epath

from normvit_jax.models import timm_layout
from normvit_jax.models.google_layout import CheckpointError, Layout

_PREFIX = "vit."
_TOP = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
        "embeddings.patch_embeddings.projection": "patch_embed.proj", "layernorm": "norm",
        "pooler.dense": "pre_logits.fc",  # ViTModel's tanh pooler on the class token: vit_jax's pre_logits
        "classifier": "head"}
_BLOCK = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$")
_BLOCK_MODULES = {"layernorm_before": "norm1", "layernorm_after": "norm2",
                  "attention.output.dense": "attn.proj", "attention.o_proj": "attn.proj",
                  "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
                  "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_QKV = {f"attention.{a}": i for i, names in enumerate((("attention.query", "q_proj"),
                                                       ("attention.key", "k_proj"),
                                                       ("attention.value", "v_proj")))
        for a in names}
# (a key pattern, the feature) of HF's ViT family this ViT has no layer for.
REFUSED = (
    (r"(^|\.)embeddings\.distillation_token$|^(cls|distillation)_classifier\.",
     "a distillation token (HF DeiT: embeddings.distillation_token; facebook/deit-*-distilled)"),
    (r"(^|\.)embeddings\.mask_token$", "a mask token (HF ViTForMaskedImageModeling / "
     "use_mask_token=True)"),
    (r"^decoder\.", "a pre-training decoder (HF ViTForMaskedImageModeling, ViTMAEForPreTraining): "
     "save the encoder alone (model.vit.state_dict())"),
)


# HF hidden_act names of the two GELUs (transformers' activations.py); others are not this ViT's
EXACT_GELU, TANH_GELU = ("gelu",), ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate")


def read_config(path: str) -> dict[str, Any] | None:
    """The ``config.json`` beside an HF weights file (a hub folder holds one), if it is a ViT's."""
    p = epath.Path(path).parent / "config.json"
    try:
        cfg = json.loads(p.read_text()) if p.exists() else None
    except (OSError, ValueError):
        return None  # another file of that name: the weights alone decide, as without one
    return cfg if isinstance(cfg, dict) and cfg.get("model_type") in ("vit", "deit") else None


def read_image_mean_std(path: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(image_mean, image_std) of the ``preprocessor_config.json`` beside an HF weights file (a hub
    folder holds one: the inputs the model was trained on), if it has both as 3 numbers."""
    p = epath.Path(path).parent / "preprocessor_config.json"
    try:
        cfg = json.loads(p.read_text()) if p.exists() else None
        mean, std = tuple(float(x) for x in cfg["image_mean"]), tuple(float(x) for x in cfg["image_std"])
    except (OSError, ValueError, TypeError, KeyError):
        return None  # absent, or another file of that name: the note says what to check
    if cfg.get("do_normalize") is False or len(mean) != 3 or len(std) != 3:
        return None
    return mean, std


def config_problem(cfg: Mapping[str, Any], spec: Any) -> str | None:
    """What the weights cannot say and ``config.json`` does, when it contradicts the model: the
    number of heads (q/k/v are (D, D) for any head count: a wrong one computes another function)
    and the activation."""
    heads = cfg.get("num_attention_heads")
    if heads is not None and heads != spec.num_heads:
        return (f"its config.json says num_attention_heads={heads}, the model has num_heads="
                f"{spec.num_heads} (the weights load either way, as another function): set "
                f"model.num_heads={heads}")
    act = cfg.get("hidden_act", "gelu")
    if act not in EXACT_GELU + TANH_GELU:
        return f"its config.json says hidden_act={act!r}; this ViT's MLP uses GELU"
    return None


def looks_like_hf(keys: Sequence[str]) -> bool:
    """Whether the keys are HF transformers' ViT names (with or without the ``vit.``/``deit.``
    prefix)."""
    return any(re.match(r"^((vit|deit)\.)?(embeddings\.patch_embeddings\.|encoder\.layer\.\d)", k)
               for k in keys)


def canonicalize(sd: Mapping[str, np.ndarray], source_grid: Sequence[int] | None = None
                 ) -> tuple[dict[str, np.ndarray], Layout]:
    """vit_jax-named arrays of an HF ViT state dict, and its ``Layout`` (numbering ``hf``). Keys
    it does not know keep their name (the loader reports them as unexpected)."""
    timm_layout.refuse(sd, REFUSED)
    if timm_layout.looks_like_timm(sd):
        timm_key = next(k for k in sd if timm_layout.looks_like_timm([k]))
        hf_key = next(k for k in sd if looks_like_hf([k]))
        raise CheckpointError(f"the keys mix two layouts: HF transformers' ({hf_key}) and timm's "
                              f"({timm_key}); save one model's state dict")
    out: dict[str, np.ndarray] = {}
    qkv: dict[tuple[str, str], list] = {}
    for key, v in sd.items():
        k = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        m = _BLOCK.match(k)
        if m:
            i, module, param = m.groups()
            if module in _QKV:
                qkv.setdefault((i, param), [None] * 3)[_QKV[module]] = (key, v)
                continue
            if module in _BLOCK_MODULES:
                out[f"blocks.{i}.{_BLOCK_MODULES[module]}.{param}"] = v
                continue
        module, _, param = k.rpartition(".")
        if k in _TOP:  # parameters (cls_token, position_embeddings)
            out[_TOP[k]] = v
        elif module in _TOP and param in ("weight", "bias"):
            out[f"{_TOP[module]}.{param}"] = v
        else:
            out[key] = v  # unknown: reported as unexpected
    for (i, param), parts in sorted(qkv.items()):
        if any(p is None for p in parts):
            names = [n for n, p in zip(("query", "key", "value"), parts) if p is None]
            raise CheckpointError(f"block {i}: attention {param} of {', '.join(names)} missing "
                                  f"(have {', '.join(p[0] for p in parts if p is not None)})")
        shapes = {p[1].shape for p in parts}
        if len(shapes) > 1:
            raise CheckpointError(f"block {i}: attention query/key/value {param}s differ in shape "
                                  f"{[p[1].shape for p in parts]}")
        out[f"blocks.{i}.attn.qkv.{param}"] = np.concatenate([p[1] for p in parts], 0)
    src, layout = timm_layout.canonicalize(out, source_grid)
    return src, layout._replace(numbering="hf")

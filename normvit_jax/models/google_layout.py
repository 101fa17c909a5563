"""Google's ViT checkpoint layouts (vit_jax, AugReg, big_vision) as this repository's ViT names them.

``canonicalize`` renames any supported layout to the vit_jax names this ViT's parameters keep
(per-block ``encoderblock_{i}``, pre-linen module numbering, the position embedding at ``POSEMB``);
``resample_grid`` resizes a position-embedding grid; ``slot_of``/``dims`` read the model's names.
Loading into a model is ``normvit_jax.pretrained``; writing the layout, ``normvit_jax.export``.
"""
from __future__ import annotations

import math
import re
import types
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from normvit_jax.models import scan_convert
from normvit_jax.models import spec as spec_lib

POSEMB = "Transformer/posembed_input/pos_embedding"
# Module names this ViT gives its norm slots, and those Google's checkpoints hold (models/spec.py).
NORM_SLOTS, CKPT_NORM_SLOTS = spec_lib.ALL_SLOTS, spec_lib.GOOGLE_SLOTS
MODEL_ONLY = frozenset({"rescale_s"})  # parameters no Google checkpoint has (RescaleViT's residual scale)
# Flax linen numbers submodules per class (big_vision, linen vit_jax); the published vit_jax files
# use pre-linen global numbering, which is what this ViT's parameter names keep.
_LINEN_TO_OLD = {"LayerNorm_0": "LayerNorm_0", "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3",
                 "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1"}
_PREFIXES = ("params/", "opt/target/", "")
BLOCK = re.compile(r"^Transformer/encoderblock_(\d+)/")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or cannot be loaded into the model as configured."""


class Layout(NamedTuple):
    prefix: str
    scanned: bool
    numbering: str            # 'vit_jax' (LayerNorm_0/MHA_1/LayerNorm_2/MlpBlock_3) | 'linen' (_0/_0/_1/_0)
    posemb_key: str | None    # where the position embedding was found
    class_slot: bool          # the position embedding has a class-token slot at index 0
    ignored: tuple[str, ...]  # keys outside the parameter prefix (optimizer state)
    norm_slots: frozenset[str] = CKPT_NORM_SLOTS  # the norm slots files of this layout hold
    # canonical name -> what it was in the file, for tensors renamed from an original norm module
    # (timm files: models/original_norms.py); the report's note
    notes: Mapping[str, str] = types.MappingProxyType({})

    def describe(self) -> str:
        pe = "none" if self.posemb_key is None else (
            f"{self.posemb_key} ({'with' if self.class_slot else 'no'} class slot)")
        name = {"timm": "timm VisionTransformer state dict: ",
                "hf": "HF transformers ViT state dict (renamed to timm's): "}.get(self.numbering, "")
        return (f"{name}prefix={self.prefix or '-'!s}, blocks={'scanned' if self.scanned else 'per-block'}, "
                f"numbering={self.numbering}, posemb={pe}")


def canonicalize(raw: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Layout]:
    """Renames any supported layout to this ViT's names (vit_jax's). The position embedding moves to
    ``POSEMB``; ``Layout.class_slot`` says whether it carries a class slot: vit_jax adds it to the
    class token (slot present iff the file has 'cls'), big_vision's top-level one never does."""
    prefix = next((p for p in _PREFIXES if f"{p}embedding/kernel" in raw), None)
    if prefix is None:
        raise CheckpointError(
            "no 'embedding/kernel' (also tried prefixes 'params/', 'opt/target/'): not a ViT checkpoint; "
            f"first keys: {sorted(raw)[:8]}")
    ignored = tuple(k for k in raw if not k.startswith(prefix))
    src = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}

    scanned_keys = [k for k in src if k.startswith("Transformer/encoderblock/")]
    if scanned_keys:  # nn.scan over blocks: one stacked array per parameter, depth first
        if any(BLOCK.match(k) for k in src):
            raise CheckpointError("checkpoint mixes scanned 'Transformer/encoderblock/' and per-block keys")
        depths = {src[k].shape[0] if src[k].ndim else 0 for k in scanned_keys}
        if len(depths) != 1:
            raise CheckpointError("scanned blocks disagree on depth (leading axis): "
                                  + ", ".join(f"{k} {src[k].shape}" for k in scanned_keys))
        src = scan_convert.unstack_blocks(src)

    mods = {k.split("/")[2] for k in src if BLOCK.match(k)}
    old = mods & {"MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"}
    new = mods & {"MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"}
    if old and new:
        raise CheckpointError(f"blocks mix vit_jax and linen module numbering: {sorted(mods)}")
    if new:
        def rename(k: str) -> str:
            if not BLOCK.match(k):
                return k
            parts = k.split("/")
            parts[2] = _LINEN_TO_OLD.get(parts[2], parts[2])
            return "/".join(parts)
        src = {rename(k): v for k, v in src.items()}

    found = [k for k in (POSEMB, "Transformer/pos_embedding", "pos_embedding") if k in src]
    if len(found) > 1:
        raise CheckpointError(f"checkpoint has several position embeddings: {found}")
    posemb_key = found[0] if found else None
    if posemb_key:
        src[POSEMB] = src.pop(posemb_key)
    class_slot = posemb_key in (POSEMB, "Transformer/pos_embedding") and "cls" in src
    return src, Layout(prefix, bool(scanned_keys), "linen" if new else "vit_jax", posemb_key, class_slot,
                       ignored)


# --------------------------------------------------------------------------------------- resampling

def _axis(n_old: int, n_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Corner-aligned sample positions, as scipy.ndimage.zoom(order=1) (what vit_jax/big_vision use).
    pos = np.zeros(n_new) if n_new == 1 or n_old == 1 else np.arange(n_new) * (n_old - 1) / (n_new - 1)
    lo = np.minimum(np.floor(pos).astype(int), max(n_old - 2, 0))
    return lo, np.minimum(lo + 1, n_old - 1), pos - lo


def resample_grid(grid: np.ndarray, new_hw: Sequence[int]) -> np.ndarray:
    """Bilinear resize of a (rows, cols, D) grid of embeddings to ``new_hw``, computed in float64."""
    g = np.asarray(grid, np.float64)
    lo, hi, f = _axis(g.shape[0], new_hw[0])
    g = g[lo] * (1 - f)[:, None, None] + g[hi] * f[:, None, None]
    lo, hi, f = _axis(g.shape[1], new_hw[1])
    g = g[:, lo] * (1 - f)[None, :, None] + g[:, hi] * f[None, :, None]
    return g.astype(grid.dtype)


def grid_of(n: int, given: Sequence[int] | None, what: str, slots: int = 0) -> tuple[int, int]:
    """The (rows, cols) of ``n`` patch positions: ``given`` if it fits, else the square grid.
    ``slots``: class slots the table holds besides them (named in the message)."""
    if slots:
        what, count = f"{what} = {slots} class slot + {n} patch positions", f"{n} are"
    else:
        count = f"{n} patch positions are"
    if given is not None:
        gh, gw = int(given[0]), int(given[1])
        if gh * gw != n:
            raise CheckpointError(f"{what}: grid {gh}x{gw} does not match its {n} patch positions")
        return gh, gw
    s = math.isqrt(n)
    if s * s != n:
        how = ("--config.init_source_grid=ROWSxCOLS (source_grid= in Python)"
               if what.startswith("checkpoint") else "image_size=(h, w)")
        raise CheckpointError(f"{what}: {count} not a square grid; pass the grid: {how}")
    return s, s


def parse_grid(text: str, key: str = "init_source_grid") -> tuple[int, int]:
    """(rows, cols) of a 'ROWSxCOLS' string (config.init_source_grid)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or 0 in (int(m.group(1)), int(m.group(2))):
        raise CheckpointError(f"{key}={text!r} is not a grid ROWSxCOLS, e.g. '14x20'")
    return int(m.group(1)), int(m.group(2))


# ------------------------------------------------------------------------------------ model names

def slot_of(name: str, slots: frozenset[str] = NORM_SLOTS) -> tuple[str, str] | None:
    """('Transformer/encoderblock_3/LayerNorm_0', 'scale') for a parameter inside a norm slot."""
    parts = name.split("/")
    for i, p in enumerate(parts[:-1]):
        if p in slots:
            return "/".join(parts[: i + 1]), "/".join(parts[i + 1:])
    return None


def dims(flat: Mapping[str, Any]) -> dict[str, Any]:
    """depth, width, heads, mlp and patch of flat vit_jax-named parameters ('?' where absent)."""
    def dim(key: str, axis: int, ndim: int | None = None) -> Any:
        ok = key in flat and (ndim is None or np.ndim(flat[key]) == ndim)
        return np.shape(flat[key])[axis] if ok else "?"
    q = "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"
    # heads from a (D, H, Dh) kernel only: a (D, H*Dh) one (heads flattened) does not say
    return dict(depth=len({m.group(1) for k in flat if (m := BLOCK.match(k))}),
                width=dim("embedding/kernel", -1), heads=dim(q, 1, ndim=3),
                mlp=dim("Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel", -1),
                patch=dim("embedding/kernel", 0))


def summary(flat: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in dims(flat).items())


def flat_heads(name: str, src: np.ndarray, shape: tuple) -> bool:
    """q/k/v/out kernels and biases stored with heads flattened ((D, H*Dh), (H*Dh,), (H*Dh, D))."""
    m = re.search(r"MultiHeadDotProductAttention_1/(query|key|value|out)/(kernel|bias)$", name)
    if not m or src.size != math.prod(shape) or src.ndim >= len(shape):
        return False
    if m.group(1) == "out":
        return m.group(2) == "bias" or src.shape[-1] == shape[-1]
    return m.group(2) == "bias" or src.shape[0] == shape[0]


def check_family(spec: Any) -> None:
    """Raises unless ``spec`` is the ViT family, the only one whose stem this layout holds."""
    if spec.family != "vit":
        raise CheckpointError(f"model.name={spec.family!r}: Google's ViT checkpoints hold a patch "
                              "embedding, this model has another stem; accepted: model.name='vit'")

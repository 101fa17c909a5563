"""``ViTSpec``: a ViT's hyperparameters resolved once from ``config.model``.

``ViTSpec.from_config`` fills sizes from ``variant``, rewrites block positions counted from the end
(``cls_token_at_block < 0``, ``last_K`` override keys), checks every choice by name, and resolves
the norm of every slot (``slot_norms``). The spec is frozen and hashable, so a module can hold it
as its one attribute and a cache can key on it; ``to_config`` writes it back as ``config.model``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import jax.numpy as jnp
from flax.core import FrozenDict

from normvit_jax import norms
from normvit_jax.models import stream_layout

# (hidden_size, depth, num_heads, mlp_dim) of the published presets.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}
# gap_fc_norm: timm's global_pool='avg' without a class token: pool, then the norm (FC_SLOT).
# token_gap_fc_norm: timm's global_pool='avg' with one (its default; DyT, Derf, MAE fine-tunes):
# the class token is in the sequence, but only the patch tokens are pooled, then FC_SLOT.
CLASSIFIERS = ("token", "gap", "gap_fc_norm", "token_gap_fc_norm")
FC_CLASSIFIERS = ("gap_fc_norm", "token_gap_fc_norm")  # the final norm is FC_SLOT, after pooling
POSEMBS = ("learn", "sincos2d", "sincos1d", "none")
PLACEMENTS = ("pre", "post", "sandwich")
PATCH_NORMS = ("none", "pre", "post", "dual", "post_posemb")
RESIDUALS = ("none", "rescale")
ATTENTION_IMPLS = ("auto", "fused", "fused_sdpa", "separate")
FUSION_BARRIERS = ("auto", "on", "off")
# model.recompute: 'gelu': the MLP's backward recomputes its GELU output from the GELU's input
# instead of keeping it from the forward (models/layers.py, MlpBlock).
RECOMPUTE = ("none", "gelu")
PARAM_INITS = ("google", "timm")  # model.param_init: the layers' initialisers (layers.timm_normal)
# model.stream_layout: the residual stream's memory layout (models/stream_layout.py)
STREAM_LAYOUTS = stream_layout.STREAM_LAYOUTS
_CHOICES = (("classifier", CLASSIFIERS), ("posemb", POSEMBS), ("norm_placement", PLACEMENTS),
            ("patch_norm", PATCH_NORMS), ("residual_scaling", RESIDUALS),
            ("attention_impl", ATTENTION_IMPLS), ("fusion_barriers", FUSION_BARRIERS),
            ("param_init", PARAM_INITS), ("recompute", RECOMPUTE),
            ("stream_layout", STREAM_LAYOUTS))

DEFAULT_NORM = FrozenDict(norms.DEFAULT)  # the norm of a slot nothing else names
MLP_RATIO = 4.0  # mlp_dim = MLP_RATIO * hidden_size where neither is set (configs/default.py's)
# Norm slots, by module name. In a block: pre/post use the first two, sandwich all four.
BLOCK_SLOTS = ("LayerNorm_0", "LayerNorm_2", "PostNorm_attn", "PostNorm_mlp")
FINAL_SLOT = "encoder_norm"
FC_SLOT = "fc_norm"  # FC_CLASSIFIERS: the final norm on the pooled vector (top level)
PATCH_SLOTS = ("patch_norm_pre", "patch_norm_post")  # always LayerNorm (Dual PatchNorm)
ALL_SLOTS = frozenset(BLOCK_SLOTS + (FINAL_SLOT,) + PATCH_SLOTS)
GOOGLE_SLOTS = frozenset(BLOCK_SLOTS[:2] + (FINAL_SLOT,))  # the slots Google's checkpoints hold


def _freeze(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        x = x.to_dict()
    if isinstance(x, str):
        return FrozenDict({"name": x})
    if isinstance(x, Mapping):
        return FrozenDict({str(k): _freeze_value(v) for k, v in x.items()})
    raise TypeError(f"norm config must be a name or a mapping with 'name', got {x!r}")


def _named_norm(key: str, value: Any) -> FrozenDict:
    """``_freeze(value)`` of ``model.<key>``; a ValueError naming it unless it names a norm (an
    override created by one option, ``--config.model.norm_overrides.final.epsilon=1e-3``, has no
    name: it was a KeyError traceback)."""
    try:
        frozen = _freeze(value)
    except TypeError:
        frozen = FrozenDict()
    if "name" not in frozen:
        shown = value.to_dict() if hasattr(value, "to_dict") else value
        raise ValueError(f"model.{key}={shown!r} names no norm; accepted: a norm name or a "
                         f"mapping with 'name', e.g. --config.model.{key}.name=layernorm")
    return frozen


def _freeze_value(v: Any) -> Any:
    if isinstance(v, Mapping) or hasattr(v, "to_dict"):
        return _freeze(v)
    return tuple(v) if isinstance(v, list) else v


def _thaw(x: Any) -> Any:
    return {k: _thaw(v) for k, v in x.items()} if isinstance(x, Mapping) else x


@dataclasses.dataclass(frozen=True)
class ViTSpec:
    """Everything a ViT is built from. Build with ``from_config``; ``dataclasses.replace`` works
    and re-checks. ``norm_overrides`` keys are absolute ('final', 'block_<i>', 'blocks_<a>_<b>');
    ``slot_norms`` is derived: the norm of every block, then the encoder norm's."""

    family: ClassVar[str] = "vit"
    title: ClassVar[str] = "ViT"  # the family's name in logs

    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    num_classes: int | None = None  # None: a spec for layout and geometry only (no head)
    variant: str | None = None      # informational: sizes above already include it
    norm: FrozenDict = DEFAULT_NORM
    norm_overrides: tuple[tuple[str, FrozenDict], ...] = ()
    norm_placement: str = "pre"
    patch_norm: str = "none"
    classifier: str = "token"
    posemb: str = "learn"
    cls_token_at_block: int = 0     # >0: the class token joins before this block
    residual_scaling: str = "none"
    final_norm: bool = True
    representation_size: int | None = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    stochastic_depth: float = 0.0
    gelu_approximate: bool = True
    qkv_bias: bool = True           # False: query/key/value without bias (timm's qkv_bias=False)
    param_init: str = "google"      # google (vit_jax/big_vision) | timm (DeiT, T2T-ViT: normal 0.02)
    attention_impl: str = "auto"
    fusion_barriers: str = "auto"
    recompute: str = "none"         # RECOMPUTE ('gelu'); config.remat recomputes whole blocks
    stream_layout: str = "auto"     # STREAM_LAYOUTS: auto pins the residual stream row-major on GPU
    scan: bool = False
    remat: bool = False
    dtype: Any = jnp.float32
    slot_norms: tuple[FrozenDict, ...] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}")
        for key, allowed in _CHOICES:
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(self, key)!r} is not accepted; "
                                 f"accepted: {list(allowed)}")
        if self.recompute == "gelu" and self.dropout_rate:
            raise ValueError(f"model.recompute='gelu' recomputes the GELU without the MLP's dropout; "
                             f"model.dropout_rate={self.dropout_rate} is not accepted with it; "
                             "accepted: model.dropout_rate=0 or model.recompute='none'")
        _check_override_keys(dict(self.norm_overrides), self.depth)
        slots = tuple(_norm_for_slot(self.norm, self.norm_overrides, i)
                      for i in list(range(self.depth)) + [None])
        for n in {self.norm, *slots}:
            norms.resolve(n["name"])  # fail early on a bad name
        object.__setattr__(self, "slot_norms", slots)

    # ------------------------------------------------------------------------------- building

    @classmethod
    def from_config(cls, model_config: Any, num_classes: int | None = None, *,
                    dtype: Any = jnp.float32, remat: bool = False) -> "ViTSpec":
        """The spec of ``config.model`` (a ConfigDict or mapping); keys the ViT does not read
        (``name``, ``mlp_ratio``) are consumed here. Raises a ValueError naming the key, its value
        and the accepted values for anything unknown."""
        cfg = cls.resolve_partial(model_config)
        if cfg["name"] != cls.family:
            raise ValueError(f"model.name={cfg['name']!r} is not known; accepted: [{cls.family!r}]")
        cls._fill_sizes(cfg)
        _absolute_blocks(cfg)
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        kw = {k: v for k, v in cfg.items() if k in fields and v is not None}
        kw["norm"] = _named_norm("norm", cfg["norm"])
        kw["norm_overrides"] = tuple(sorted((str(k), _named_norm(f"norm_overrides.{k}", v))
                                            for k, v in cfg["norm_overrides"].items()))
        kw.update(num_classes=num_classes, dtype=dtype, remat=remat)
        return cls(**kw)

    @classmethod
    def resolve_partial(cls, model_config: Any) -> dict[str, Any]:
        """``config.model`` (a ConfigDict, or a partial mapping: tests, an older run's
        config.json) as a plain dict with every key the resolution reads, once: a key left out
        or None takes the family's default (the dataclass field's, or configs/default.py's
        ``mlp_ratio``), so nothing downstream restates a default."""
        cfg = dict(model_config.to_dict() if hasattr(model_config, "to_dict") else model_config)
        given = {k: v for k, v in cfg.items() if v is not None}
        fields = {f.name: f.default for f in dataclasses.fields(cls)
                  if f.init and f.default is not dataclasses.MISSING}
        defaults = {**fields, "name": cls.family, "norm": DEFAULT_NORM, "norm_overrides": {},
                    "mlp_ratio": MLP_RATIO}
        sizes = dict.fromkeys(("variant", "hidden_size", "depth", "num_heads", "mlp_dim",
                               "patch_size"))
        return {**sizes, **cfg, **defaults, **given}

    @classmethod
    def _fill_sizes(cls, cfg: dict[str, Any]) -> None:
        """Fills the sizes from ``variant`` in place and checks them (a family's own presets)."""
        _apply_variant(cfg)
        complete_sizes(cfg)

    def to_config(self) -> dict[str, Any]:
        """``config.model`` as a plain dict (sizes explicit); ``from_config`` of it is this spec
        (but for num_classes, dtype and remat, which are not model-config keys)."""
        out = {"name": self.family}
        for f in dataclasses.fields(self):
            if f.init and f.name not in ("num_classes", "dtype", "remat"):
                out[f.name] = getattr(self, f.name)
        out["norm"] = _thaw(self.norm)
        out["norm_overrides"] = {k: _thaw(v) for k, v in self.norm_overrides} or None
        return out

    def with_norm_overrides(self, overrides: Mapping[str, Any]) -> "ViTSpec":
        """This spec with ``overrides`` (absolute keys) added to its norm overrides; a key already
        there is replaced."""
        merged = {**dict(self.norm_overrides), **{str(k): _freeze(v) for k, v in overrides.items()}}
        return dataclasses.replace(self, norm_overrides=tuple(sorted(merged.items())))

    # -------------------------------------------------------------------------------- queries

    def block_norm(self, index: int) -> dict[str, Any]:
        """The norm config of every slot of block ``index``."""
        return _thaw(self.slot_norms[index])

    def final_norm_config(self) -> dict[str, Any]:
        """The norm config of the encoder norm (``norm_overrides.final`` or ``norm``)."""
        return _thaw(self.slot_norms[-1])

    def slot_norm_name(self, slot_path: str) -> str:
        """Registry name of the norm in a slot given by its parameter path, e.g.
        'Transformer/encoderblock_3/LayerNorm_0' or 'Transformer/encoder_norm'."""
        parts = slot_path.split("/")
        if parts[-1] in PATCH_SLOTS:
            return norms.name_of(DEFAULT_NORM)
        for p in parts:
            if p.startswith("encoderblock_") and p[len("encoderblock_"):].isdigit():
                return self.slot_norms[int(p[len("encoderblock_"):])]["name"]
        return self.slot_norms[-1]["name"]

    def stem_macs(self, image_size: int) -> int:
        """Multiply-adds of the patch embedding for one square image (a family with another stem
        overrides this)."""
        n = (int(image_size) // self.patch_size) ** 2
        return n * self.patch_size ** 2 * 3 * self.hidden_size

    def variant_title(self) -> str:
        """The published name of ``variant``, e.g. 'ViT-B/16'."""
        return f"{self.title}-{self.variant}"

    @property
    def uses_cls(self) -> bool:
        """Whether the class token is in the sequence (classified from or not)."""
        return self.classifier in ("token", "token_gap_fc_norm")

    @property
    def fc_norm(self) -> bool:
        """Whether the final norm sits after pooling (FC_SLOT) instead of in the encoder."""
        return self.classifier in FC_CLASSIFIERS

    def block_has_cls(self) -> list[bool]:
        """Per block: whether the class token is in its sequence (token classifier and joined)."""
        return [self.uses_cls and i >= self.cls_token_at_block for i in range(self.depth)]

    @property
    def scan_length(self) -> int:
        """Blocks 0..k-1 that ``scan`` stacks into one ``nn.scan`` (``Transformer/encoderblock``):
        the leading run with the same norm and the same tokens. Later blocks (after a norm
        override or where a late class token joins) stay unrolled as ``encoderblock_{i}``."""
        k = 1
        while k < self.depth and self.slot_norms[k] == self.slot_norms[0]:
            k += 1
        if self.uses_cls and 0 < self.cls_token_at_block < k:
            k = self.cls_token_at_block  # the sequence grows by the class token there
        return k

    def grid(self, image_size: int | tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of the patch grid of an image size; raises if not divisible."""
        h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image size {h}x{w} is not divisible by model.patch_size={p}")
        return h // p, w // p


def _apply_variant(cfg: dict[str, Any]) -> None:
    """Fills hidden_size/depth/num_heads/mlp_dim/patch_size from 'Ti/16'-style ``variant`` where
    not set: explicit fields win over the preset."""
    variant = cfg["variant"]
    if variant:
        try:
            size, patch = str(variant).split("/")
            hidden, depth, heads, mlp = VARIANTS[size]
            patch = int(patch)
        except (ValueError, KeyError):
            raise ValueError(
                f"model.variant={variant!r} is not a known preset; accepted: "
                f"'<size>/<patch>' with size in {sorted(VARIANTS)} and an integer patch, e.g. 'S/16'"
            ) from None
        preset = dict(hidden_size=hidden, depth=depth, num_heads=heads, mlp_dim=mlp, patch_size=patch)
        for k, v in preset.items():
            if cfg[k] is None:
                cfg[k] = v


def complete_sizes(cfg: dict[str, Any]) -> None:
    """Checks the sizes (set or filled from a variant), derives mlp_dim from mlp_ratio where
    unset, and checks every choice by name."""
    for k in ("hidden_size", "depth", "num_heads", "patch_size"):
        if not cfg[k]:
            raise ValueError(f"model.{k} is not set and no model.variant gives it")
    if cfg["mlp_dim"] is None:
        cfg["mlp_dim"] = int(cfg["hidden_size"] * cfg["mlp_ratio"])
        if cfg["mlp_dim"] < 1:  # an MLP of width 0: a ZeroDivisionError in its initializer
            raise ValueError(f"model.mlp_ratio={cfg['mlp_ratio']!r} gives an MLP of width 0 at "
                             f"model.hidden_size={cfg['hidden_size']}; accepted: a ratio >= "
                             f"1/{cfg['hidden_size']}, or set model.mlp_dim")
    width = cfg["hidden_size"]
    if width % cfg["num_heads"]:
        raise ValueError(f"model.num_heads={cfg['num_heads']} does not divide model.hidden_size="
                         f"{width}; accepted: a divisor of {width}: "
                         f"{[d for d in range(1, width + 1) if width % d == 0]}")
    for key, allowed in _CHOICES:
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"model.{key}={cfg[key]!r} is not accepted; accepted: {list(allowed)}")


def _absolute_blocks(cfg: dict[str, Any]) -> None:
    """Block positions counted from the end, so a layout survives a depth override: a negative
    ``cls_token_at_block`` is depth + value; a ``last_K`` override key is
    ``blocks_<depth-K>_<depth>``."""
    depth = int(cfg["depth"])
    at = cfg["cls_token_at_block"]
    # at >= depth: the token would join after the last block and the head would read a constant
    if not -depth < at < depth:
        raise ValueError(f"model.cls_token_at_block={at} with depth={depth} is not accepted; "
                         f"accepted: 0, 1..{depth - 1}, or -1..-{depth - 1} (counted from the end)")
    if at < 0:
        cfg["cls_token_at_block"] = depth + at
    overrides = cfg["norm_overrides"]
    if overrides and any(str(k).startswith("last_") for k in overrides):
        out = {}
        for key, value in overrides.items():
            parts = str(key).split("_")
            if parts[0] == "last":
                if len(parts) != 2 or not parts[1].isdigit() or not 1 <= int(parts[1]) <= depth:
                    raise ValueError(f"model.norm_overrides key {key!r} is not accepted; accepted: "
                                     f"'last_<k>' with 1 <= k <= depth={depth}")
                key = f"blocks_{depth - int(parts[1])}_{depth}"
            out[key] = value
        cfg["norm_overrides"] = out


def _check_override_keys(overrides: Mapping[str, Any], depth: int) -> None:
    for key in overrides:
        parts = key.split("_")
        ok = key == "final" or (
            parts[0] == "blocks" and len(parts) == 3 and all(p.isdigit() for p in parts[1:])
            and 0 <= int(parts[1]) < int(parts[2]) <= depth) or (
            parts[0] == "block" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) < depth)
        if not ok:
            raise ValueError(
                f"model.norm_overrides key {key!r} is not accepted; accepted: 'final', "
                f"'block_<i>', 'blocks_<start>_<end>' (end exclusive) with 0 <= i < depth={depth}, "
                "or 'last_<k>'")


def _norm_for_slot(norm: FrozenDict, overrides: tuple[tuple[str, FrozenDict], ...],
                   block: int | None) -> FrozenDict:
    """The norm of block ``block``'s slots (None: the encoder norm): ``norm`` unless an override
    selects it. Where keys overlap the narrowest wins ('block_A' over any range), whatever the
    keys' order."""
    best, width = norm, None
    for key, cfg in overrides:
        if key == "final" and block is None:
            return cfg
        if block is None:
            continue
        parts = key.split("_")
        if parts[0] == "blocks" and len(parts) == 3 and int(parts[1]) <= block < int(parts[2]):
            w = int(parts[2]) - int(parts[1])
        elif parts[0] == "block" and len(parts) == 2 and int(parts[1]) == block:
            w = 0
        else:
            continue
        if width is None or w < width:
            best, width = cfg, w
    return best

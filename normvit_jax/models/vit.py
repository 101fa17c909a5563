"""Vision Transformer (Dosovitskiy et al. 2021) whose normalization layers come from a registry.

Parameter names follow Google's vit_jax checkpoints where the layer is the same: ``embedding``,
``cls``, ``Transformer/posembed_input/pos_embedding``, ``Transformer/encoderblock_{i}/LayerNorm_0``,
``MultiHeadDotProductAttention_1/{query,key,value,out}``, ``LayerNorm_2``, ``MlpBlock_3/Dense_{0,1}``,
``Transformer/encoder_norm``, ``pre_logits``, ``head``. A norm slot keeps its Google name whatever
the normalizer in it, so one renaming table serves every norm.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from normvit_jax import norms

# (hidden_size, depth, num_heads, mlp_dim) of the published presets.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
    "H": (1280, 32, 16, 5120),
}
PATCH_SIZES = (2, 4, 8, 14, 16, 32)
CLASSIFIERS = ("token", "gap")
POSEMBS = ("learn", "sincos2d", "none")
PLACEMENTS = ("pre", "post", "sandwich")
PATCH_NORMS = ("none", "pre", "post", "dual", "post_posemb")
RESIDUALS = ("none", "rescale")


def resolve_model_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Fills hidden_size/depth/num_heads/mlp_dim/patch_size from ``variant`` where not set.

    ``variant`` is 'Ti/16'-style; explicit fields win over the preset. Raises a ValueError naming
    the key, its value and the accepted values for anything unknown.
    """
    cfg = dict(cfg)
    if cfg.get("name", "vit") != "vit":
        raise ValueError(f"model.name={cfg['name']!r} is not known; accepted: ['vit']")
    variant = cfg.get("variant")
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
            if cfg.get(k) is None:
                cfg[k] = v
    for k in ("hidden_size", "depth", "num_heads", "patch_size"):
        if not cfg.get(k):
            raise ValueError(f"model.{k} is not set and no model.variant gives it")
    if cfg.get("mlp_dim") is None:
        cfg["mlp_dim"] = int(cfg["hidden_size"] * cfg.get("mlp_ratio", 4.0))
    if cfg["hidden_size"] % cfg["num_heads"]:
        raise ValueError(f"model.hidden_size={cfg['hidden_size']} is not divisible by "
                         f"model.num_heads={cfg['num_heads']}")
    for key, allowed in (("classifier", CLASSIFIERS), ("posemb", POSEMBS),
                         ("norm_placement", PLACEMENTS), ("patch_norm", PATCH_NORMS),
                         ("residual_scaling", RESIDUALS)):
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"model.{key}={cfg[key]!r} is not accepted; accepted: {list(allowed)}")
    return cfg


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0) -> np.ndarray:
    """Fixed 2-D sine-cosine position embedding (MoCo v3 / big_vision), shape (1, rows*cols, dim)."""
    if dim % 4:
        raise ValueError(f"sincos2d position embedding needs hidden_size divisible by 4, got {dim}")
    y, x = np.mgrid[: grid[0], : grid[1]]
    omega = 1.0 / temperature ** (np.arange(dim // 4) / (dim // 4 - 1 if dim > 4 else 1))
    y = y.reshape(-1)[:, None] * omega[None]
    x = x.reshape(-1)[:, None] * omega[None]
    pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return pe[None].astype(np.float32)


def token_stats(x: jax.Array) -> dict[str, jax.Array]:
    """Per-block summaries of a token tensor (B, T, C), averaged over the batch, in float32.

    chan_*: statistics across channels per token, averaged over tokens; tok_*: across tokens per
    channel, averaged over channels.
    """
    x = x.astype(jnp.float32)
    return {
        "chan_mean": jnp.mean(jnp.mean(x, -1)),
        "chan_var": jnp.mean(jnp.var(x, -1)),
        "tok_mean": jnp.mean(jnp.mean(x, 1)),
        "tok_var": jnp.mean(jnp.var(x, 1)),
        "max_abs": jnp.max(jnp.abs(x)),
    }


def norm_for_slot(model_cfg_norm: Any, overrides: Mapping[str, Any] | None, slot: str,
                  block: int | None) -> Any:
    """The norm config of a slot: ``model.norm`` unless an override selects the slot.

    Override keys: 'final' (the encoder norm), 'blocks_A_B' (every slot of blocks A..B-1),
    'block_A' (one block).
    """
    for key, cfg in (overrides or {}).items():
        if key == "final" and slot == "encoder_norm":
            return cfg
        if block is None:
            continue
        parts = key.split("_")
        if parts[0] == "blocks" and len(parts) == 3 and int(parts[1]) <= block < int(parts[2]):
            return cfg
        if parts[0] == "block" and len(parts) == 2 and int(parts[1]) == block:
            return cfg
    return model_cfg_norm


def check_override_keys(overrides: Mapping[str, Any] | None, depth: int) -> None:
    for key in overrides or {}:
        parts = key.split("_")
        ok = key == "final" or (
            parts[0] == "blocks" and len(parts) == 3 and all(p.isdigit() for p in parts[1:])
            and 0 <= int(parts[1]) < int(parts[2]) <= depth) or (
            parts[0] == "block" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) < depth)
        if not ok:
            raise ValueError(
                f"model.norm_overrides key {key!r} is not accepted; accepted: 'final', "
                f"'block_<i>' or 'blocks_<start>_<end>' (end exclusive) with 0 <= i < depth={depth}")


class PatchEmbed(nn.Module):
    """Patchify + linear projection; the kernel (P, P, C_in, D) is Google's conv kernel.

    Patches are flattened in (ph, pw, c) order so a LayerNorm can see each patch's pixels (DPN).
    """

    patch_size: int
    hidden_size: int
    patch_norm: str
    dtype: Any

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        b, h, w, c = images.shape
        p = self.patch_size
        gh, gw = h // p, w // p
        x = images.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, gh * gw, p * p * c)
        if self.patch_norm in ("pre", "dual"):
            x = norms.create({"name": "layernorm"}, dim=p * p * c, name="patch_norm_pre")(x)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (p, p, c, self.hidden_size),
                            jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.hidden_size,), jnp.float32)
        x = jnp.dot(x.astype(self.dtype), kernel.reshape(p * p * c, -1).astype(self.dtype))
        return x + bias.astype(self.dtype)


class Attention(nn.Module):
    """Multi-head self-attention with Google's parameter layout: query/key/value kernels (D, H, Dh),
    out kernel (H, Dh, D). Fused ``jax.nn.dot_product_attention`` unless weights are requested or
    attention dropout is on."""

    num_heads: int
    dtype: Any
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, capture: bool) -> jax.Array:
        d = x.shape[-1]
        head_dim = d // self.num_heads
        dense = lambda name: nn.DenseGeneral((self.num_heads, head_dim), dtype=self.dtype,
                                             param_dtype=jnp.float32,
                                             kernel_init=nn.initializers.xavier_uniform(), name=name)
        q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
        use_dropout = train and self.dropout_rate > 0
        if capture or use_dropout:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            weights = jax.nn.softmax(logits / math.sqrt(head_dim), axis=-1)
            if capture:
                self.sow("intermediates", "attention", weights)
            if use_dropout:
                weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.dtype), v)
        else:
            out = jax.nn.dot_product_attention(q, k, v)
        return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32,
                               kernel_init=nn.initializers.xavier_uniform(), name="out")(out)


class MlpBlock(nn.Module):
    mlp_dim: int
    dtype: Any
    dropout_rate: float = 0.0
    gelu_approximate: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        init = dict(kernel_init=nn.initializers.xavier_uniform(),
                    bias_init=nn.initializers.normal(stddev=1e-6))
        y = nn.Dense(self.mlp_dim, dtype=self.dtype, param_dtype=jnp.float32, name="Dense_0", **init)(x)
        y = nn.gelu(y, approximate=self.gelu_approximate)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = nn.Dense(x.shape[-1], dtype=self.dtype, param_dtype=jnp.float32, name="Dense_1", **init)(y)
        return nn.Dropout(self.dropout_rate)(y, deterministic=not train)


def drop_path(module: nn.Module, x: jax.Array, rate: float, train: bool) -> jax.Array:
    """Stochastic depth: drops the whole residual branch per sample, rescaling the survivors."""
    if not train or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask = jax.random.bernoulli(module.make_rng("dropout"), keep, (x.shape[0],) + (1,) * (x.ndim - 1))
    return jnp.where(mask, x / keep, jnp.zeros_like(x))


class EncoderBlock(nn.Module):
    """One transformer block with the norm placement chosen in the config."""

    index: int
    depth: int
    num_heads: int
    mlp_dim: int
    norm_cfg: Any
    grid: tuple[int, int] | None
    num_prefix_tokens: int
    placement: str = "pre"
    residual_scaling: str = "none"
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    gelu_approximate: bool = True
    dtype: Any = jnp.float32

    def _norm(self, slot: str, x: jax.Array, train: bool) -> jax.Array:
        norm = norms.create(self.norm_cfg, dim=x.shape[-1], num_heads=self.num_heads, grid=self.grid,
                            num_prefix_tokens=self.num_prefix_tokens, slot=slot, name=slot)
        y = norm(x, train=train)
        if self.is_mutable_collection("intermediates"):
            self.sow("intermediates", f"{slot}_in", token_stats(x))
            self.sow("intermediates", f"{slot}_out", token_stats(y))
        return y

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, capture: bool = False) -> jax.Array:
        attn = Attention(self.num_heads, self.dtype, self.attention_dropout_rate,
                         name="MultiHeadDotProductAttention_1")
        mlp = MlpBlock(self.mlp_dim, self.dtype, self.dropout_rate, self.gelu_approximate,
                       name="MlpBlock_3")
        dropout = nn.Dropout(self.dropout_rate)
        branch = lambda f, y: drop_path(self, dropout(f(y), deterministic=not train),
                                        self.drop_path_rate, train)
        if self.placement == "pre":
            x = x + branch(lambda y: attn(y, train, capture), self._norm("LayerNorm_0", x, train))
            y = self._norm("LayerNorm_2", x, train)
        elif self.placement == "post":
            x = self._norm("LayerNorm_0", x + branch(lambda y: attn(y, train, capture), x), train)
            return self._norm("LayerNorm_2", x + branch(lambda y: mlp(y, train), x), train)
        else:  # sandwich: norm before and after each branch
            a = attn(self._norm("LayerNorm_0", x, train), train, capture)
            x = x + drop_path(self, dropout(self._norm("PostNorm_attn", a, train),
                                            deterministic=not train), self.drop_path_rate, train)
            m = mlp(self._norm("LayerNorm_2", x, train), train)
            return x + drop_path(self, dropout(self._norm("PostNorm_mlp", m, train),
                                               deterministic=not train), self.drop_path_rate, train)
        if self.residual_scaling == "rescale":
            # RescaleViT: sqrt(i/(i+1)) * x + s/sqrt(L) * MLP(y), i 1-based, s learnable (init 1).
            s = self.param("rescale_s", nn.initializers.ones, (), jnp.float32)
            i = self.index + 1
            return (math.sqrt(i / (i + 1)) * x
                    + (s / math.sqrt(self.depth)).astype(x.dtype) * branch(lambda z: mlp(z, train), y))
        return x + branch(lambda z: mlp(z, train), y)


class ViT(nn.Module):
    """ViT classifier. ``apply(variables, images, train=..., capture=...)`` -> logits (float32).

    With ``capture=True`` and ``mutable=['intermediates']`` the attention weights of every block
    and the token statistics before/after each norm slot are recorded; never in training by default.
    """

    num_classes: int
    patch_size: int
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    norm: Any = None
    norm_overrides: Any = None
    norm_placement: str = "pre"
    patch_norm: str = "none"
    classifier: str = "token"
    posemb: str = "learn"
    cls_token_at_block: int = 0
    residual_scaling: str = "none"
    final_norm: bool = True
    representation_size: int | None = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    stochastic_depth: float = 0.0
    gelu_approximate: bool = True
    remat: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False, capture: bool = False) -> jax.Array:
        norm_cfg = self.norm if self.norm is not None else {"name": "layernorm"}
        _, h, w, _ = images.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image size {h}x{w} is not divisible by model.patch_size={p}")
        grid = (h // p, w // p)
        x = PatchEmbed(p, self.hidden_size, self.patch_norm, self.dtype, name="embedding")(
            images.astype(self.dtype))
        if self.patch_norm in ("post", "dual"):
            x = norms.create({"name": "layernorm"}, dim=self.hidden_size, name="patch_norm_post")(x)
        use_cls = self.classifier == "token"
        b = x.shape[0]
        cls = None
        if use_cls:
            cls = self.param("cls", nn.initializers.zeros, (1, 1, self.hidden_size), jnp.float32)
            cls = jnp.tile(cls.astype(self.dtype), (b, 1, 1))
        cls_joins_late = use_cls and self.cls_token_at_block > 0
        if use_cls and not cls_joins_late:
            x = jnp.concatenate([cls, x], axis=1)
        with_prefix = int(use_cls and not cls_joins_late)
        spec = _Spec(**{f: getattr(self, f) for f in _Spec.__dataclass_fields__})
        x = Encoder(spec, grid, with_prefix, name="Transformer")(x, cls, train, capture)
        if use_cls:
            x = x[:, 0]
        else:
            x = jnp.mean(x, axis=1)
        if self.representation_size:
            x = jnp.tanh(nn.Dense(self.representation_size, dtype=self.dtype,
                                  param_dtype=jnp.float32, name="pre_logits")(x))
        logits = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32,
                          kernel_init=nn.initializers.zeros, name="head")(x)
        return logits.astype(jnp.float32)


class AddPositionEmbs(nn.Module):
    """Learned position embedding (Google's 'posembed_input/pos_embedding', class slot included
    when the class token is in the sequence)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1,) + x.shape[1:],
                        jnp.float32)
        return x + pe.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The ViT fields the encoder reads (a plain value: a Module must not be another's attribute)."""

    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    norm: Any
    norm_overrides: Any
    norm_placement: str
    patch_norm: str
    posemb: str
    cls_token_at_block: int
    residual_scaling: str
    final_norm: bool
    dropout_rate: float
    attention_dropout_rate: float
    stochastic_depth: float
    gelu_approximate: bool
    remat: bool
    dtype: Any


class Encoder(nn.Module):
    """Position embedding, the blocks and the final norm (Google's 'Transformer' scope)."""

    vit: Any  # the ViT's hyperparameters (a _Spec), not a module
    grid: tuple[int, int]
    with_prefix: int

    @nn.compact
    def __call__(self, x, cls, train: bool, capture: bool):
        v = self.vit
        if v.posemb == "learn":
            x = AddPositionEmbs(name="posembed_input")(x)
        elif v.posemb == "sincos2d":
            pe = jnp.asarray(sincos_2d(self.grid, v.hidden_size), x.dtype)
            if self.with_prefix:
                pe = jnp.concatenate([jnp.zeros((1, self.with_prefix, v.hidden_size), x.dtype), pe], 1)
            x = x + pe
        if v.patch_norm == "post_posemb":
            x = norms.create({"name": "layernorm"}, dim=v.hidden_size, name="patch_norm_post")(x)
        x = nn.Dropout(v.dropout_rate)(x, deterministic=not train)
        block_cls = nn.remat(EncoderBlock, static_argnums=(2, 3)) if v.remat else EncoderBlock
        prefix = self.with_prefix
        for i in range(v.depth):
            if cls is not None and v.cls_token_at_block == i and i > 0:
                x = jnp.concatenate([cls, x], axis=1)
                prefix = 1
            x = block_cls(
                index=i, depth=v.depth, num_heads=v.num_heads, mlp_dim=v.mlp_dim,
                norm_cfg=norm_for_slot(v.norm, v.norm_overrides, "block", i) or {"name": "layernorm"},
                grid=self.grid, num_prefix_tokens=prefix, placement=v.norm_placement,
                residual_scaling=v.residual_scaling, dropout_rate=v.dropout_rate,
                attention_dropout_rate=v.attention_dropout_rate,
                drop_path_rate=v.stochastic_depth * i / max(v.depth - 1, 1),
                gelu_approximate=v.gelu_approximate, dtype=v.dtype,
                name=f"encoderblock_{i}")(x, train, capture)
        if cls is not None and v.cls_token_at_block >= v.depth:
            x = jnp.concatenate([cls, x], axis=1)
            prefix = 1
        if v.final_norm:
            final_cfg = norm_for_slot(v.norm, v.norm_overrides, "encoder_norm", None) or {"name": "layernorm"}
            norm = norms.create(final_cfg, dim=v.hidden_size, num_heads=v.num_heads, grid=self.grid,
                                num_prefix_tokens=prefix, slot="encoder_norm", name="encoder_norm")
            y = norm(x, train=train)
            if self.is_mutable_collection("intermediates"):
                self.sow("intermediates", "encoder_norm_in", token_stats(x))
                self.sow("intermediates", "encoder_norm_out", token_stats(y))
            x = y
        return x


def create(model_cfg: Mapping[str, Any], num_classes: int, dtype: Any = jnp.float32,
           remat: bool = False) -> ViT:
    """Builds the ViT described by ``config.model`` (a ConfigDict or mapping)."""
    cfg = resolve_model_config(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    cfg.pop("name", None)
    check_override_keys(cfg.get("norm_overrides"), cfg["depth"])
    norms.resolve((cfg.get("norm") or {"name": "layernorm"})["name"])  # fail early on a bad name
    for ov in (cfg.get("norm_overrides") or {}).values():
        norms.resolve(ov["name"])
    fields = {f for f in ViT.__dataclass_fields__ if f not in ("parent", "name")}
    kwargs = {k: v for k, v in cfg.items() if k in fields}
    kwargs.update(num_classes=num_classes, dtype=dtype, remat=remat)
    return ViT(**kwargs)

"""Vision Transformer (Dosovitskiy et al. 2021) whose normalization layers come from a registry.

Parameter names follow Google's vit_jax checkpoints where the layer is the same: ``embedding``,
``cls``, ``Transformer/posembed_input/pos_embedding``, ``Transformer/encoderblock_{i}/LayerNorm_0``,
``MultiHeadDotProductAttention_1/{query,key,value,out}``, ``LayerNorm_2``, ``MlpBlock_3/Dense_{0,1}``,
``Transformer/encoder_norm``, ``pre_logits``, ``head``. A norm slot keeps its Google name whatever
the normalizer in it, so one renaming table serves every norm.
"""
from __future__ import annotations

import dataclasses
import logging
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
ATTENTION_IMPLS = ("auto", "fused", "fused_sdpa", "separate")
FUSION_BARRIERS = ("auto", "on", "off")


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
                         ("residual_scaling", RESIDUALS), ("attention_impl", ATTENTION_IMPLS),
                         ("fusion_barriers", FUSION_BARRIERS)):
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"model.{key}={cfg[key]!r} is not accepted; accepted: {list(allowed)}")
    return _absolute_blocks(cfg)


def _absolute_blocks(cfg: dict[str, Any]) -> dict[str, Any]:
    """Block positions counted from the end, so a layout survives a depth override: a negative
    ``cls_token_at_block`` is depth + value; a ``last_K`` override key is
    ``blocks_<depth-K>_<depth>``."""
    depth = int(cfg["depth"])
    at = cfg.get("cls_token_at_block") or 0
    if at < 0:
        if depth + at < 1:
            raise ValueError(f"model.cls_token_at_block={at} with depth={depth} is not accepted; "
                             f"accepted: 0, 1..depth, or -1..-{depth - 1} (counted from the end)")
        cfg["cls_token_at_block"] = depth + at
    overrides = cfg.get("norm_overrides")
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
    'block_A' (one block); 'last_K' (the last K blocks) is rewritten to 'blocks_A_B' by
    ``resolve_model_config``. Where keys overlap the narrowest wins ('block_A' over any range),
    whatever the keys' order (a ConfigDict sorts them).
    """
    best, width = model_cfg_norm, None
    for key, cfg in (overrides or {}).items():
        if key == "final" and slot == "encoder_norm":
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
                f"'block_<i>', 'blocks_<start>_<end>' (end exclusive) with 0 <= i < depth={depth}, "
                "or 'last_<k>'")


def drop_path_rate(stochastic_depth: float, index: int, depth: int) -> float:
    """Drop-path rate of block ``index``: linear from 0 to ``stochastic_depth`` at the last block."""
    return stochastic_depth * index / max(depth - 1, 1)


def _same_norm(a: Any, b: Any) -> bool:
    as_dict = lambda c: c.to_dict() if hasattr(c, "to_dict") else (
        {"name": c} if isinstance(c, str) else dict(c or {"name": "layernorm"}))
    return as_dict(a) == as_dict(b)


def _scan_length(v: Any) -> int:
    get = (lambda k: v[k]) if isinstance(v, Mapping) else (lambda k: getattr(v, k))
    depth, overrides, norm = get("depth"), get("norm_overrides"), get("norm")
    first = norm_for_slot(norm, overrides, "block", 0)
    k = 1
    while k < depth and _same_norm(norm_for_slot(norm, overrides, "block", k), first):
        k += 1
    late_cls = get("cls_token_at_block")
    if get("classifier") == "token" and 0 < late_cls < k:
        k = late_cls  # the sequence grows by the class token there
    return k


def scan_length(model_cfg: Mapping[str, Any]) -> int:
    """Blocks 0..k-1 that ``model.scan`` stacks into one ``nn.scan`` (``Transformer/encoderblock``):
    the leading run with the same norm and the same tokens. Later blocks (after a norm override
    or where a late class token joins) stay unrolled as ``encoderblock_{i}``."""
    cfg = dict(model_cfg)
    cfg.setdefault("norm_overrides", None)
    cfg.setdefault("norm", None)
    cfg.setdefault("cls_token_at_block", 0)
    cfg.setdefault("classifier", "token")
    return _scan_length(_absolute_blocks(cfg))


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


def _xavier(fan_shape: tuple[int, int]) -> Callable:
    """Xavier-uniform on the flattened (fan_in, fan_out) shape, reshaped: DenseGeneral's init."""
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return nn.initializers.xavier_uniform()(key, fan_shape, dtype).reshape(shape)
    return init


class _Projection(nn.Module):
    """Only declares Google's ``kernel``/``bias`` of one projection (initialised as flax's
    Dense/DenseGeneral would); the parent does the math with ``dense``, so q/k/v can run as ONE
    matmul while the checkpoint keeps three separate (D, H, Dh) kernels."""

    kernel_shape: tuple[int, ...]
    bias_shape: tuple[int, ...]
    fan_shape: tuple[int, int]
    bias_std: float = 0.0  # 0: zeros (DenseGeneral), else normal(bias_std) (Google's MLP)

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        kernel = self.param("kernel", _xavier(self.fan_shape), self.kernel_shape, jnp.float32)
        bias_init = nn.initializers.normal(self.bias_std) if self.bias_std else nn.initializers.zeros
        bias = self.param("bias", bias_init, self.bias_shape, jnp.float32)
        return kernel, bias


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype: Any,
          barriers: bool = False) -> jax.Array:
    """x (N, K) @ kernel (K, F) + bias, computed in ``dtype``.

    ``barriers`` (XLA:CPU, see ``grad_barrier``): a custom backward that reads a stored input and
    a stored output gradient (so XLA's transposing copies for the weight gradient are plain
    copies, not a re-run of the norm or GELU that produced them), and whose bias gradient sums
    the stored gradient (fused with its producer, that column sum ran 10x slower).
    """
    k, b = kernel.astype(dtype), bias.astype(dtype)
    if barriers:
        return _dense_stored(x.astype(dtype), k, b)
    return jnp.dot(x.astype(dtype), k) + b


@jax.custom_vjp
def _dense_stored(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(x, w) + b


def _dense_stored_fwd(x, w, b):
    x = jax.lax.optimization_barrier(x)
    return jnp.dot(x, w) + b, (x, w)


def _dense_stored_bwd(res, dy):
    x, w = res
    dy = jax.lax.optimization_barrier(dy)
    dx = jnp.dot(dy, w.T)
    dw = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))
    db = jnp.sum(dy, axis=0)
    return dx, dw, db


_dense_stored.defvjp(_dense_stored_fwd, _dense_stored_bwd)


def sdpa(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` on (B, T, H, Dh): cuDNN's fused attention when compiling
    for GPU in a half dtype (JAX's own default is XLA's implementation everywhere), XLA's if cuDNN
    refuses the shapes or is absent."""
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as e:
            logging.warning("cuDNN attention not used (%s); XLA's attention instead", e)
    return jax.nn.dot_product_attention(q, k, v)


class Attention(nn.Module):
    """Multi-head self-attention with Google's parameter layout: query/key/value kernels (D, H, Dh),
    out kernel (H, Dh, D); the same initialisation as flax's DenseGeneral.

    impl 'fused': the three kernels are concatenated in the forward and applied as one
    (B*T, D) x (D, 3D) matmul, then all heads attend in two einsums with a float32 softmax; on
    XLA:CPU this is faster than three projections and ``jax.nn.dot_product_attention`` (measured
    in docs/benchmarks.md). 'fused_sdpa': the same projection, then
    ``jax.nn.dot_product_attention`` with cuDNN's fused (flash) attention on GPU in bfloat16 or
    float16 (``sdpa``), XLA's otherwise. 'auto' (default): 'fused_sdpa' when compiling for GPU,
    'fused' elsewhere. 'separate': three DenseGeneral and ``sdpa``.
    Capture and attention dropout need the weights, so they always take the einsum path.
    Every impl has the same parameters.
    """

    num_heads: int
    dtype: Any
    dropout_rate: float = 0.0
    impl: str = "auto"
    barriers: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, capture: bool) -> jax.Array:
        b, t, d = x.shape
        h = self.num_heads
        hd = d // h
        use_dropout = train and self.dropout_rate > 0
        impl = self.impl
        if impl == "auto":
            impl = "fused_sdpa" if jax.default_backend() == "gpu" else "fused"
        if impl == "separate":
            general = lambda name: nn.DenseGeneral((h, hd), dtype=self.dtype, param_dtype=jnp.float32,
                                                   kernel_init=nn.initializers.xavier_uniform(),
                                                   name=name)
            q, k, v = general("query")(x), general("key")(x), general("value")(x)
            if not (capture or use_dropout):
                out = sdpa(q, k, v)
                return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32,
                                       kernel_init=nn.initializers.xavier_uniform(),
                                       name="out")(out)
            wo, bo = None, None
        else:
            proj = lambda name: _Projection((d, h, hd), (h, hd), (d, d), name=name)()
            (wq, bq), (wk, bk), (wv, bv) = proj("query"), proj("key"), proj("value")
            w = jnp.concatenate([wq.reshape(d, d), wk.reshape(d, d), wv.reshape(d, d)], axis=1)
            bias = jnp.concatenate([bq.reshape(d), bk.reshape(d), bv.reshape(d)])
            qkv = dense(x.reshape(b * t, d), w, bias, self.dtype, self.barriers)
            qkv = qkv.reshape(b, t, 3, h, hd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            wo, bo = _Projection((h, hd, d), (d,), (d, d), name="out")()
            if impl == "fused_sdpa" and not (capture or use_dropout):
                out = sdpa(q, k, v)  # (B, T, H, Dh)
                y = dense(out.reshape(b * t, d), wo.reshape(d, d), bo, self.dtype, self.barriers)
                return y.reshape(b, t, d)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        weights = jax.nn.softmax(logits / math.sqrt(hd), axis=-1)
        if capture:
            self.sow("intermediates", "attention", weights)
        if use_dropout:
            weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.dtype), v)
        if wo is None:
            return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32,
                                   kernel_init=nn.initializers.xavier_uniform(), name="out")(out)
        y = dense(out.reshape(b * t, d), wo.reshape(d, d), bo, self.dtype, self.barriers)
        return y.reshape(b, t, d)


class MlpBlock(nn.Module):
    """Dense_0 -> GELU -> Dense_1 with Google's names and flax Dense's initialisation."""

    mlp_dim: int
    dtype: Any
    dropout_rate: float = 0.0
    gelu_approximate: bool = True
    barriers: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        b, t, d = x.shape
        w0, b0 = _Projection((d, self.mlp_dim), (self.mlp_dim,), (d, self.mlp_dim), 1e-6,
                             name="Dense_0")()
        y = dense(x.reshape(b * t, d), w0, b0, self.dtype, self.barriers)
        y = nn.gelu(y, approximate=self.gelu_approximate)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        w1, b1 = _Projection((self.mlp_dim, d), (d,), (self.mlp_dim, d), 1e-6, name="Dense_1")()
        y = dense(y, w1, b1, self.dtype, self.barriers).reshape(b, t, d)
        return nn.Dropout(self.dropout_rate)(y, deterministic=not train)


@jax.custom_vjp
def grad_barrier(x: jax.Array) -> jax.Array:
    """Identity whose backward passes the cotangent through ``lax.optimization_barrier``.

    Why: the gradient of the residual stream is a sum over every block above; XLA:CPU fuses that
    elementwise chain into each consumer instead of storing it, and the consumers include the
    transposing copies of the weight-gradient matmuls, so the chain is recomputed, in a strided
    order, once per block (a ViT-Ti/4 step took 4.7x longer, docs/benchmarks.md). A barrier stores
    it once. XLA:CPU drops barriers before fusion unless ``--xla_disable_hlo_passes=
    cse_barrier_expander`` is set (the benchmarks' 'tuned' preset); otherwise this is a no-op.
    """
    return x


def _grad_barrier_fwd(x):
    return x, None


def _grad_barrier_bwd(_, g):
    return (jax.lax.optimization_barrier(g),)


grad_barrier.defvjp(_grad_barrier_fwd, _grad_barrier_bwd)


def barriers_on(setting: str) -> bool:
    """``model.fusion_barriers``: 'auto' places them when compiling for CPU (the only backend
    where they were measured to help), 'on'/'off' force it."""
    return setting == "on" or (setting == "auto" and jax.default_backend() == "cpu")


def rescale_coefficient(index: int) -> float:
    """RescaleViT's residual coefficient sqrt(i/(i+1)) of block ``index`` (i = index + 1)."""
    i = index + 1
    return math.sqrt(i / (i + 1))


def drop_path(module: nn.Module, x: jax.Array, rate: float | jax.Array, train: bool,
              enabled: bool | None = None) -> jax.Array:
    """Stochastic depth: drops the whole residual branch per sample, rescaling the survivors.

    ``rate`` may be traced (a scanned block's own rate); ``enabled`` then says statically whether
    any block drops at all.
    """
    if enabled is None:
        enabled = not isinstance(rate, (int, float)) or rate != 0.0
    if not train or not enabled:
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
    attention_impl: str = "auto"
    fusion_barriers: bool = False
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
        return self._block(x, train, capture, None)

    def _block(self, x: jax.Array, train: bool, capture: bool,
               consts: Mapping[str, jax.Array] | None) -> jax.Array:
        """``consts``: this block's drop-path rate and RescaleViT coefficient as arrays when the
        block is one step of an ``nn.scan`` (they differ per block); None: from the fields."""
        if consts is None:
            rate: float | jax.Array = self.drop_path_rate
            res_coef: float | jax.Array = rescale_coefficient(self.index)
        else:
            rate, res_coef = consts["drop_path_rate"], consts["res_coef"]
        dp_on = self.drop_path_rate != 0.0  # static: a scanned run drops if any of its blocks does
        attn = Attention(self.num_heads, self.dtype, self.attention_dropout_rate,
                         self.attention_impl, self.fusion_barriers,
                         name="MultiHeadDotProductAttention_1")
        mlp = MlpBlock(self.mlp_dim, self.dtype, self.dropout_rate, self.gelu_approximate,
                       self.fusion_barriers, name="MlpBlock_3")
        dropout = nn.Dropout(self.dropout_rate)
        dpath = lambda y: drop_path(self, y, rate, train, dp_on)
        branch = lambda f, y: dpath(dropout(f(y), deterministic=not train))
        # The residual stream's gradient is materialised at the block's input and after its first
        # residual add (see grad_barrier): XLA:CPU otherwise re-derives it from every block above.
        bar = grad_barrier if self.fusion_barriers else (lambda v: v)
        x = bar(x)
        if self.placement == "pre":
            x = bar(x + branch(lambda y: attn(y, train, capture), self._norm("LayerNorm_0", x, train)))
            y = self._norm("LayerNorm_2", x, train)
        elif self.placement == "post":
            x = bar(self._norm("LayerNorm_0", x + branch(lambda y: attn(y, train, capture), x), train))
            return self._norm("LayerNorm_2", x + branch(lambda y: mlp(y, train), x), train)
        else:  # sandwich: norm before and after each branch
            a = attn(self._norm("LayerNorm_0", x, train), train, capture)
            x = bar(x + dpath(dropout(self._norm("PostNorm_attn", a, train), deterministic=not train)))
            m = mlp(self._norm("LayerNorm_2", x, train), train)
            return x + dpath(dropout(self._norm("PostNorm_mlp", m, train), deterministic=not train))
        if self.residual_scaling == "rescale":
            # RescaleViT: sqrt(i/(i+1)) * x + s/sqrt(L) * MLP(y), i 1-based, s learnable (init 1).
            s = self.param("rescale_s", nn.initializers.ones, (), jnp.float32)
            return (res_coef * x
                    + (s / math.sqrt(self.depth)).astype(x.dtype) * branch(lambda z: mlp(z, train), y))
        return x + branch(lambda z: mlp(z, train), y)


class _ScannedBlock(EncoderBlock):
    """An EncoderBlock as the body of ``nn.scan``: (carry, per-block constants) -> (carry, None).
    train/capture are attributes (static), not scanned arguments."""

    scan_train: bool = False
    scan_capture: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, consts: Mapping[str, jax.Array]) -> tuple[jax.Array, None]:
        return self._block(x, self.scan_train, self.scan_capture, consts), None


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
    attention_impl: str = "auto"
    fusion_barriers: str = "auto"
    scan: bool = False
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
    classifier: str
    posemb: str
    cls_token_at_block: int
    residual_scaling: str
    final_norm: bool
    dropout_rate: float
    attention_dropout_rate: float
    stochastic_depth: float
    gelu_approximate: bool
    attention_impl: str
    fusion_barriers: str
    scan: bool
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
        prefix = self.with_prefix

        def block_kwargs(i: int, prefix: int) -> dict[str, Any]:
            return dict(
                index=i, depth=v.depth, num_heads=v.num_heads, mlp_dim=v.mlp_dim,
                norm_cfg=norm_for_slot(v.norm, v.norm_overrides, "block", i) or {"name": "layernorm"},
                grid=self.grid, num_prefix_tokens=prefix, placement=v.norm_placement,
                residual_scaling=v.residual_scaling, dropout_rate=v.dropout_rate,
                attention_dropout_rate=v.attention_dropout_rate,
                drop_path_rate=drop_path_rate(v.stochastic_depth, i, v.depth),
                gelu_approximate=v.gelu_approximate, attention_impl=v.attention_impl,
                fusion_barriers=barriers_on(v.fusion_barriers), dtype=v.dtype)

        start = 0
        if v.scan:
            # Blocks 0..k-1 are identical but for their drop-path rate and RescaleViT coefficient,
            # which enter as scanned arrays: one block is traced and compiled instead of k.
            k = _scan_length(v)
            body = nn.remat(_ScannedBlock, prevent_cse=False) if v.remat else _ScannedBlock
            scanned = nn.scan(body, variable_axes={"params": 0, "batch_stats": 0, "intermediates": 0},
                              split_rngs={"params": True, "dropout": True}, in_axes=0, length=k)
            consts = {
                "drop_path_rate": np.asarray([drop_path_rate(v.stochastic_depth, i, v.depth)
                                              for i in range(k)], np.float32),
                "res_coef": np.asarray([rescale_coefficient(i) for i in range(k)], np.float32),
            }
            kw = block_kwargs(0, prefix)
            kw["drop_path_rate"] = v.stochastic_depth if k > 1 else kw["drop_path_rate"]
            x, _ = scanned(**kw, scan_train=train, scan_capture=capture, name="encoderblock")(
                x, consts)
            start = k
        block_cls = nn.remat(EncoderBlock, static_argnums=(2, 3)) if v.remat else EncoderBlock
        for i in range(start, v.depth):
            if cls is not None and v.cls_token_at_block == i and i > 0:
                x = jnp.concatenate([cls, x], axis=1)
                prefix = 1
            x = block_cls(**block_kwargs(i, prefix), name=f"encoderblock_{i}")(x, train, capture)
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

"""T2T-ViT (Yuan et al., ICCV 2021): a ViT whose stem is Tokens-to-Token, the model Unified
Normalization is published on (UN's reference: hikvision-research/Unified-Normalization,
image_classification/models/{t2t_vit,token_performer}.py).

The stem ('performer' tokens type): three soft splits (torch ``nn.Unfold``: kernel 7/stride 4/
padding 2, then 3/2/1 twice; 224 -> 56 -> 28 -> 14 tokens a side, i.e. an effective patch of 16)
with a one-head Performer layer after each of the first two, then a linear projection to the
width. The backbone is this project's ViT (models/vit.py) with T2T-ViT's choices set by the
presets: no query/key/value bias, exact GELU, a fixed 1-D sinusoid position table over the class
token and the patches (``posemb='sincos1d'``). Every norm slot of the stem (``norm1``/``norm2`` of
``attention1``/``attention2``) holds ``model.stem_norm`` (None: ``model.norm``), as UN's
``T2t_vit_14_all_un1d`` puts UN1d in every slot.

The Performer's random features are a fixed orthogonal matrix (torch: a frozen parameter drawn at
init); here it is a constant drawn from a fixed seed per layer, so it is neither trained nor
decayed nor stored, and the same in every run. The stem's linear layers are initialised as the
reference (torch's trunc_normal_(std=.02), i.e. normal(0.02)); the backbone as ``model.param_init``
says ('timm' in the presets: the reference's).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict

from normvit_jax import norms
from normvit_jax.models.layers import timm_normal
from normvit_jax.models.spec import ViTSpec, _freeze, _thaw, complete_sizes
from normvit_jax.models.vit import ViT

# (hidden_size, depth, num_heads, mlp_ratio) of T2T-ViT's 'performer' models (t2t_vit.py).
T2T_VARIANTS: dict[str, tuple[int, int, int, float]] = {
    "T2T-7": (256, 7, 4, 2.0),
    "T2T-10": (256, 10, 4, 2.0),
    "T2T-12": (256, 12, 4, 2.0),
    "T2T-14": (384, 14, 6, 3.0),
    "T2T-19": (448, 19, 7, 3.0),
    "T2T-24": (512, 24, 8, 3.0),
}
SOFT_SPLITS = ((7, 4, 2), (3, 2, 1), (3, 2, 1))  # (kernel, stride, padding) of each soft split
STEM_SCOPE = "tokens_to_token"


def soft_split(x: jax.Array, kernel: int, stride: int, padding: int
               ) -> tuple[jax.Array, tuple[int, int]]:
    """torch ``nn.Unfold`` on NHWC: (B, H, W, C) -> ((B, H'*W', C*k*k), (H', W')), features in
    Unfold's (channel, row, col) order, zero padding. Strided slices: exact on every backend."""
    b, h, w, c = x.shape
    ho, wo = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    taps = [xp[:, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride]
            for i in range(kernel) for j in range(kernel)]
    out = jnp.stack(taps, axis=-1)  # (B, H', W', C, k*k)
    return out.reshape(b, ho * wo, c * kernel * kernel), (ho, wo)


def random_features(emb: int, m: int, seed: int) -> np.ndarray:
    """(m, emb), orthonormal rows (m <= emb) or columns (m > emb), times sqrt(m): the reference's
    ``nn.init.orthogonal_(randn(m, emb)) * sqrt(m)`` (QR with r's signs), from a fixed seed."""
    a = np.random.default_rng(seed).standard_normal((m, emb))
    wide = m < emb
    q, r = np.linalg.qr(a.T if wide else a)
    q = q * np.sign(np.diag(r))[None]
    return ((q.T if wide else q) * math.sqrt(m)).astype(np.float32)


def _positive_features(x: jax.Array, w: jax.Array) -> jax.Array:
    """exp(w.x - |x|^2 / 2) / sqrt(m): positive random features of the softmax kernel (float32)."""
    x = x.astype(jnp.float32)
    return jnp.exp(jnp.einsum("bti,mi->btm", x, w) - 0.5 * jnp.sum(x * x, -1, keepdims=True)) \
        / math.sqrt(w.shape[0])




class TokenPerformer(nn.Module):
    """T2T-ViT's one-head Performer layer (Token_performer): v + proj(linear attention), then
    + MLP(norm2(.)). Parameter names follow the reference (kqv, proj, norm1, norm2, mlp_0, mlp_2)."""

    emb: int
    kernel_ratio: float
    dropout_rate: float
    norm: FrozenDict
    grid: tuple[int, int]
    seed: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, step: jax.Array | None = None) -> jax.Array:
        """``step``: the global train step, for norms with ``TAKES_STEP`` (as models/vit.py)."""
        def norm(slot, y):
            n = norms.create(self.norm, dim=y.shape[-1], grid=self.grid, slot=slot, name=slot)
            return n(y, train=train, step=step) if getattr(n, "TAKES_STEP", False) else n(y, train=train)

        def dense(features, name):
            return nn.Dense(features, dtype=self.dtype, param_dtype=jnp.float32,
                            kernel_init=timm_normal(), name=name)

        dropout = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        k, q, v = jnp.split(dense(3 * self.emb, "kqv")(norm("norm1", x)), 3, axis=-1)
        w = jnp.asarray(random_features(self.emb, int(self.emb * self.kernel_ratio), self.seed))
        kp, qp = _positive_features(k, w), _positive_features(q, w)  # (B, T, m)
        denom = jnp.einsum("btm,bm->bt", qp, jnp.sum(kp, axis=1))[..., None]
        kptv = jnp.einsum("btn,btm->bnm", v.astype(jnp.float32), kp)  # (B, emb, m)
        y = jnp.einsum("btm,bnm->btn", qp, kptv) / (denom + 1e-8)
        y = v + dropout(dense(self.emb, "proj")(y.astype(self.dtype)))  # v is the skip (reference)
        h = nn.gelu(dense(self.emb, "mlp_0")(norm("norm2", y)), approximate=False)
        return y + dropout(dense(self.emb, "mlp_2")(h))


class TokensToToken(nn.Module):
    """Images (B, H, W, C) -> tokens (B, H/16 * W/16, hidden_size)."""

    spec: "T2TViTSpec"

    @nn.compact
    def __call__(self, images: jax.Array, train: bool, step: jax.Array | None = None) -> jax.Array:
        s = self.spec
        x, hw = soft_split(images, *SOFT_SPLITS[0])
        for i, split in enumerate(SOFT_SPLITS[1:], start=1):
            x = TokenPerformer(s.token_dim, s.kernel_ratio, s.t2t_dropout_rate, s.stem_norm_config,
                               hw, i, s.dtype, name=f"attention{i}")(x, train, step)
            x, hw = soft_split(x.reshape(x.shape[0], *hw, x.shape[-1]), *split)
        return nn.Dense(s.hidden_size, dtype=s.dtype, param_dtype=jnp.float32,
                        kernel_init=timm_normal(), name="project")(x)


@dataclasses.dataclass(frozen=True)
class T2TViTSpec(ViTSpec):
    """A ViTSpec with the T2T stem's settings; ``variant`` 'T2T-14' etc. fills the sizes."""

    family: ClassVar[str] = "t2t_vit"
    title: ClassVar[str] = "T2T-ViT"

    token_dim: int = 64               # the Performer layers' width (reference token_dim)
    kernel_ratio: float = 0.5         # random features per channel (m = token_dim * ratio)
    t2t_dropout_rate: float = 0.1     # Token_performer's dp1/dp2 (reference default 0.1)
    stem_norm: FrozenDict | None = None  # None (or a config's name None): model.norm

    def __post_init__(self) -> None:
        if self.patch_size != 16:
            raise ValueError(f"model.patch_size={self.patch_size} is not accepted for model.name="
                             "'t2t_vit'; accepted: 16 (the soft splits' strides 4 x 2 x 2)")
        if self.patch_norm != "none":
            raise ValueError(f"model.patch_norm={self.patch_norm!r} is not accepted for "
                             "model.name='t2t_vit' (no patch embedding); accepted: 'none'")
        if self.stem_norm is not None and not isinstance(self.stem_norm, FrozenDict):
            frozen = _freeze(self.stem_norm)  # a config's {'name': None} means "model.norm"
            object.__setattr__(self, "stem_norm", frozen if frozen.get("name") else None)
        if self.stem_norm is not None:
            norms.resolve(self.stem_norm["name"])
        super().__post_init__()

    @classmethod
    def _fill_sizes(cls, cfg: dict[str, Any]) -> None:
        variant = cfg["variant"]
        if variant:
            if variant not in T2T_VARIANTS:
                raise ValueError(f"model.variant={variant!r} is not a T2T-ViT preset; accepted: "
                                 f"{list(T2T_VARIANTS)}")
            hidden, depth, heads, ratio = T2T_VARIANTS[variant]
            preset = dict(hidden_size=hidden, depth=depth, num_heads=heads,
                          mlp_dim=int(hidden * ratio), patch_size=16)
            for k, v in preset.items():
                if cfg[k] is None:
                    cfg[k] = v
        if cfg["patch_size"] is None:
            cfg["patch_size"] = 16
        complete_sizes(cfg)

    def variant_title(self) -> str:
        return f"T2T-ViT-{str(self.variant).split('-')[-1]}"  # 'T2T-14' -> 'T2T-ViT-14'

    def to_config(self) -> dict[str, Any]:
        out = super().to_config()
        out["stem_norm"] = None if self.stem_norm is None else _thaw(self.stem_norm)
        return out

    @property
    def stem_norm_config(self) -> FrozenDict:
        return self.norm if self.stem_norm is None else self.stem_norm

    def slot_norm_name(self, slot_path: str) -> str:
        if slot_path.split("/")[0] == STEM_SCOPE:
            return norms.name_of(self.stem_norm_config)
        return super().slot_norm_name(slot_path)

    def stem_macs(self, image_size: int) -> int:
        """Multiply-adds of the stem for one square image: the Performers' projections, random
        features and linear attention, and the final projection."""
        size, c, macs = int(image_size), 3, 0
        e, m = self.token_dim, int(self.token_dim * self.kernel_ratio)
        for i, (k, st, p) in enumerate(SOFT_SPLITS):
            size = (size + 2 * p - k) // st + 1
            n, d = size * size, c * k * k
            if i == len(SOFT_SPLITS) - 1:
                return macs + n * d * self.hidden_size
            # kqv; k and q features; (k features)^T v; q features x that; proj; two MLP layers
            macs += n * (d * 3 * e + 2 * e * m + e * m + m * e + 3 * e * e)
            c = e
        return macs


class T2TViT(ViT):
    """ViT with the Tokens-to-Token stem (``model.name='t2t_vit'``); same call as ``ViT``."""

    spec_class: ClassVar[type] = T2TViTSpec
    spec: T2TViTSpec

    def tokens(self, images: jax.Array, train: bool, step: jax.Array | None = None) -> jax.Array:
        return TokensToToken(self.spec, name=STEM_SCOPE)(images, train, step)

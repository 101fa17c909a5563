"""Layers of the ViT and the backend-specific kernels they run on.

The layers keep Google's vit_jax parameter names and initialisations. Their matmuls go through
``fusion_barriers.dense`` (XLA:CPU speed workarounds, ``model.fusion_barriers``); ``sdpa`` picks
cuDNN's fused attention on GPU. None of them changes what is computed.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from normvit_jax import norms
from normvit_jax.models import padded_attention
from normvit_jax.models.gelu import gelu, gelu_bias
from normvit_jax.models.fusion_barriers import dense
from normvit_jax.models.spec import DEFAULT_NORM


# Collections sown for the extra training losses (train/aux_losses.py) when the train step
# makes them mutable: the residual stream after each residual add, and each attention's maximum
# probability per (image, head, query) (before attention dropout).
RESIDUAL = "residual_stream"
ATTENTION_MAX = "attention_max"


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


# model.param_init 'timm': timm's ViT, DeiT and T2T-ViT initialise every Linear with torch's
# trunc_normal_(std=.02), whose default cut is +-2 in absolute value (100 std): a plain normal.
TIMM_STD = 0.02


def timm_normal() -> Callable:
    return nn.initializers.normal(TIMM_STD)


def _torch_conv_default(fan_in: int) -> Callable:
    """torch.nn.Conv2d's default init of weight and bias: uniform(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def sincos_1d(length: int, dim: int) -> np.ndarray:
    """Fixed 1-D sinusoid table (Vaswani et al.; T2T-ViT's ``get_sinusoid_encoding``), shape
    (1, length, dim): position p, channel j: sin (j even) / cos (j odd) of p / 10000^(2*(j//2)/dim)."""
    j = np.arange(dim)
    angle = np.arange(length)[:, None] / np.power(10_000.0, 2 * (j // 2) / dim)[None]
    table = np.where(j % 2 == 0, np.sin(angle), np.cos(angle))
    return table[None].astype(np.float32)


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


def drop_path_rate(stochastic_depth: float, index: int, depth: int) -> float:
    """Drop-path rate of block ``index``: linear from 0 to ``stochastic_depth`` at the last block."""
    return stochastic_depth * index / max(depth - 1, 1)


class PatchEmbed(nn.Module):
    """Patchify + linear projection; the kernel (P, P, C_in, D) is Google's conv kernel.

    Patches are flattened in (ph, pw, c) order so a LayerNorm can see each patch's pixels (DPN).
    """

    patch_size: int
    hidden_size: int
    patch_norm: str
    dtype: Any
    param_init: str = "google"  # 'timm': torch Conv2d's default (DeiT's patch embedding)

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        b, h, w, c = images.shape
        p = self.patch_size
        gh, gw = h // p, w // p
        x = images.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, gh * gw, p * p * c)
        if self.patch_norm in ("pre", "dual"):
            x = norms.create(DEFAULT_NORM, dim=p * p * c, name="patch_norm_pre")(x)
        google = self.param_init == "google"
        torch_init = _torch_conv_default(p * p * c)
        kernel = self.param("kernel", nn.initializers.lecun_normal() if google else torch_init,
                            (p, p, c, self.hidden_size), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros if google else torch_init,
                          (self.hidden_size,), jnp.float32)
        # matmul, not dot: the same dot_general for XLA; jax2onnx writes MatMul, not Einsum
        x = jnp.matmul(x.astype(self.dtype), kernel.reshape(p * p * c, -1).astype(self.dtype))
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
    use_bias: bool = True  # False: no bias parameter, zeros returned
    param_init: str = "google"  # 'timm': kernel normal(0.02), bias zeros

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        google = self.param_init == "google"
        kernel = self.param("kernel", _xavier(self.fan_shape) if google else timm_normal(),
                            self.kernel_shape, jnp.float32)
        if not self.use_bias:
            return kernel, jnp.zeros(self.bias_shape, jnp.float32)
        bias_init = (nn.initializers.normal(self.bias_std) if self.bias_std and google
                     else nn.initializers.zeros)
        bias = self.param("bias", bias_init, self.bias_shape, jnp.float32)
        return kernel, bias


def sdpa(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` on (B, T, H, Dh). When compiling for GPU in a half dtype:
    cuDNN's fused (flash) attention, with the tokens padded to a multiple of 16 and masked by
    their true length (JAX's cuDNN path refuses a ViT's 197 tokens; ``padded_attention``), else
    XLA's (JAX's own default everywhere) if cuDNN refuses the shapes or is absent."""
    impl = padded_attention.choose_implementation(q.dtype)
    if impl is not None:
        try:
            return padded_attention.padded_dot_product_attention(q, k, v, implementation=impl)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            _warn_once(f"{impl} attention not used ({e}); XLA's attention instead")
    return jax.nn.dot_product_attention(q, k, v)


# --- attention for export (normvit_jax.deploy.onnx_format) ----------------------------------
_MATMUL_ATTENTION = contextvars.ContextVar("normvit_jax_matmul_attention", default=False)


@contextlib.contextmanager
def matmul_attention() -> Iterator[None]:
    """Models traced inside compute ``Attention``'s two einsums as timm writes them: explicit
    transposes to (B, H, T, Dh) and batched ``jnp.matmul``s (``attention_matmul``). The same
    function of the same parameters, for converters that keep an einsum as a slower operator
    (jax2onnx writes ONNX ``Einsum``, which ONNX Runtime runs far slower than ``MatMul``)."""
    token = _MATMUL_ATTENTION.set(True)
    try:
        yield
    finally:
        _MATMUL_ATTENTION.reset(token)


def attention_matmul(q: jax.Array, k: jax.Array, v: jax.Array, dtype: Any) -> jax.Array:
    """softmax(q k^T / sqrt(Dh)) v on (B, T, H, Dh), the logits and softmax in float32, as the
    einsum path of ``Attention`` computes it; (B, T, H, Dh)."""
    q = jnp.transpose(q, (0, 2, 1, 3))  # (B, H, T, Dh)
    k = jnp.transpose(k, (0, 2, 3, 1))  # (B, H, Dh, T)
    v = jnp.transpose(v, (0, 2, 1, 3))
    logits = jnp.matmul(q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.transpose(jnp.matmul(weights.astype(dtype), v), (0, 2, 1, 3))


def _concrete_concatenate(arrays: list, axis: int = 0) -> jax.Array:
    """``jnp.concatenate``, done on the host when every array is concrete (an export's closed-over
    parameters): the graph then holds one constant, not a join (and, for a bias, an ``Expand``
    to the dynamic batch) on every call."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return jnp.concatenate(arrays, axis=axis)
    return jnp.asarray(np.concatenate([np.asarray(a) for a in arrays], axis=axis))


def token_dense(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype: Any,
                barriers: bool = False) -> jax.Array:
    """(B, T, K) @ kernel (K, F) + bias -> (B, T, F). Computed on the flattened (B*T, K), which
    XLA:CPU runs faster; traced inside ``matmul_attention()`` on the (B, T, K) tokens as they
    are, so the ONNX graph holds timm's 3-D ``MatMul`` + ``Add``: ONNX Runtime fuses a 2-D
    ``MatMul`` + ``Add`` into a ``Gemm``, which ran a ViT-S/16's linear layers slower in a
    profile (docs/deploy.md, "Speed")."""
    if _MATMUL_ATTENTION.get():  # matmul, not dot: jax2onnx writes MatMul, not Einsum
        return jnp.matmul(x.astype(dtype), kernel.astype(dtype)) + bias.astype(dtype)
    b, t, k = x.shape
    return dense(x.reshape(b * t, k), kernel, bias, dtype, barriers).reshape(b, t, -1)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """One line per distinct reason and process, not one per layer and compile."""
    logging.warning(message)


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
    Capture, attention dropout and the ATTENTION_MAX collection need the weights, so they always
    take the einsum path. Traced inside ``matmul_attention()`` (the ONNX export), every impl
    computes its attention with transposes and batched matmuls instead (``attention_matmul``).
    Every impl has the same parameters; ``qkv_bias=False`` drops the query/key/value biases.
    """

    num_heads: int
    dtype: Any
    dropout_rate: float = 0.0
    impl: str = "auto"
    barriers: bool = False
    qkv_bias: bool = True
    param_init: str = "google"  # 'timm': normal(0.02) kernels, zero biases

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, capture: bool) -> jax.Array:
        b, t, d = x.shape
        h = self.num_heads
        hd = d // h
        use_dropout = train and self.dropout_rate > 0
        # Not at init: the sown values would land in the initial variables.
        sow_max = self.is_mutable_collection(ATTENTION_MAX) and not self.is_initializing()
        # matmul_attention(): every impl as timm's matmuls (attention_matmul)
        matmul = _MATMUL_ATTENTION.get() and not (capture or use_dropout or sow_max)
        impl = self.impl
        kinit = nn.initializers.xavier_uniform() if self.param_init == "google" else timm_normal()
        if impl == "auto":
            impl = "fused_sdpa" if jax.default_backend() == "gpu" else "fused"
        if impl == "separate":
            general = lambda name: nn.DenseGeneral((h, hd), dtype=self.dtype, param_dtype=jnp.float32,
                                                   kernel_init=kinit, use_bias=self.qkv_bias,
                                                   name=name)
            q, k, v = general("query")(x), general("key")(x), general("value")(x)
            if not (capture or use_dropout or sow_max or matmul):
                out = sdpa(q, k, v)
                return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32,
                                       kernel_init=kinit, name="out")(out)
            wo, bo = None, None
        else:
            proj = lambda name: _Projection((d, h, hd), (h, hd), (d, d), use_bias=self.qkv_bias,
                                            param_init=self.param_init, name=name)()
            (wq, bq), (wk, bk), (wv, bv) = proj("query"), proj("key"), proj("value")
            # An export with concrete parameters joins them once, into a constant of the graph
            cat = _concrete_concatenate if matmul else jnp.concatenate
            w = cat([wq.reshape(d, d), wk.reshape(d, d), wv.reshape(d, d)], axis=1)
            bias = cat([bq.reshape(d), bk.reshape(d), bv.reshape(d)])
            qkv = token_dense(x, w, bias, self.dtype, self.barriers)
            qkv = qkv.reshape(b, t, 3, h, hd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            wo, bo = _Projection((h, hd, d), (d,), (d, d), param_init=self.param_init, name="out")()
            if impl == "fused_sdpa" and not (capture or use_dropout or sow_max or matmul):
                out = sdpa(q, k, v)  # (B, T, H, Dh)
                return token_dense(out.reshape(b, t, d), wo.reshape(d, d), bo, self.dtype,
                                   self.barriers)
        if matmul:
            out = attention_matmul(q, k, v, self.dtype)
        else:
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            weights = jax.nn.softmax(logits / math.sqrt(hd), axis=-1)
            if capture:
                self.sow("intermediates", "attention", weights)
            if sow_max:
                self.sow(ATTENTION_MAX, "max", jnp.max(weights, axis=-1))
            if use_dropout:
                weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
            out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.dtype), v)
        if wo is None:
            return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, param_dtype=jnp.float32,
                                   kernel_init=kinit, name="out")(out)
        return token_dense(out.reshape(b, t, d), wo.reshape(d, d), bo, self.dtype, self.barriers)


class MlpBlock(nn.Module):
    """Dense_0 -> GELU -> Dense_1 with Google's names and flax Dense's initialisation."""

    mlp_dim: int
    dtype: Any
    dropout_rate: float = 0.0
    gelu_approximate: bool = True
    barriers: bool = False
    param_init: str = "google"  # 'timm': normal(0.02) kernels, zero biases
    recompute_gelu: bool = False  # model.recompute='gelu'

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        b, t, d = x.shape
        w0, b0 = _Projection((d, self.mlp_dim), (self.mlp_dim,), (d, self.mlp_dim), 1e-6,
                             param_init=self.param_init, name="Dense_0")()
        w1, b1 = _Projection((self.mlp_dim, d), (d,), (self.mlp_dim, d), 1e-6,
                             param_init=self.param_init, name="Dense_1")()
        if train and self.recompute_gelu and self.dropout_rate == 0.0:
            # GELU and Dense_1 as one checkpointed function of the GELU's input: the backward keeps
            # only y (B, T, mlp_dim) and recomputes the GELU's output for Dense_1's weight
            # gradient, where the plain path keeps both (the largest activations of a block).
            y = token_dense(x, w0, b0, self.dtype, self.barriers)
            tail = lambda h, w, bias: token_dense(gelu(h, self.gelu_approximate), w, bias,
                                                  self.dtype, self.barriers)
            return jax.checkpoint(tail, policy=jax.checkpoint_policies.nothing_saveable)(y, w1, b1)
        if train and not self.barriers and not _MATMUL_ATTENTION.get():
            # Dense_0's bias added inside the GELU's kernel, whose backward keeps the matmul's
            # output (models/gelu.py, ``gelu_bias``): XLA:GPU otherwise wrote the biased
            # activation out beside the GELU's output (B/16: -310 MB a block's forward). Where
            # the CPU's fusion barriers are on, Dense_0 keeps its stored-gradient matmul.
            z = jnp.dot(x.reshape(b * t, d).astype(self.dtype), w0.astype(self.dtype))
            y = gelu_bias(z, b0.astype(self.dtype), self.gelu_approximate).reshape(b, t, -1)
        else:
            # training: a GELU whose backward keeps only y (models/gelu.py); inference (and so
            # the export's trace) runs the plain one: same values, no backward to save for
            act = gelu if train else lambda h, approximate: nn.gelu(h, approximate=approximate)
            y = act(token_dense(x, w0, b0, self.dtype, self.barriers), self.gelu_approximate)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=not train)
        y = token_dense(y, w1, b1, self.dtype, self.barriers)
        return nn.Dropout(self.dropout_rate)(y, deterministic=not train)


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


class AddPositionEmbs(nn.Module):
    """Learned position embedding (Google's 'posembed_input/pos_embedding', class slot included
    when the class token is in the sequence)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1,) + x.shape[1:],
                        jnp.float32)
        return x + pe.astype(x.dtype)

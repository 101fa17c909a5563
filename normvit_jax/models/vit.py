"""Vision Transformer (Dosovitskiy et al. 2021) whose normalization layers come from a registry.

Parameter names follow Google's vit_jax checkpoints where the layer is the same: ``embedding``,
``cls``, ``Transformer/posembed_input/pos_embedding``, ``Transformer/encoderblock_{i}/LayerNorm_0``,
``MultiHeadDotProductAttention_1/{query,key,value,out}``, ``LayerNorm_2``, ``MlpBlock_3/Dense_{0,1}``,
``Transformer/encoder_norm``, ``pre_logits``, ``head``. A norm slot keeps its Google name whatever
the normalizer in it, so one renaming table serves every norm. Every hyperparameter comes from one
``ViTSpec`` (models/spec.py); the layers are in models/layers.py.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from normvit_jax import norms
from normvit_jax.models import stream_layout
from normvit_jax.models.fusion_barriers import barriers_on, grad_barrier
from normvit_jax.models.layers import (ATTENTION_MAX, RESIDUAL, AddPositionEmbs, Attention, MlpBlock, PatchEmbed,
                                       drop_path, drop_path_rate, rescale_coefficient, sincos_1d,
                                       sincos_2d, timm_normal, token_stats)
from normvit_jax.models.spec import DEFAULT_NORM, FC_SLOT, FINAL_SLOT, ViTSpec


def _sown_norm(module: nn.Module, cfg: Any, x: jax.Array, train: bool, spec: ViTSpec,
               grid: tuple[int, int], prefix: int, slot: str,
               step: jax.Array | None = None) -> jax.Array:
    """The norm of one slot; under capture, its input and output token statistics are sown.
    A norm class with ``TAKES_STEP`` (norms/progressive.py) also gets the global train step."""
    norm = norms.create(cfg, dim=x.shape[-1], num_heads=spec.num_heads, grid=grid,
                        num_prefix_tokens=prefix, slot=slot, name=slot)
    y = norm(x, train=train, step=step) if getattr(norm, "TAKES_STEP", False) else norm(x, train=train)
    if module.is_mutable_collection("intermediates"):
        module.sow("intermediates", f"{slot}_in", token_stats(x))
        module.sow("intermediates", f"{slot}_out", token_stats(y))
    return y


def _sown_stream(module: nn.Module, name: str, x: jax.Array) -> jax.Array:
    """``x``, sown as ``name`` in the RESIDUAL collection when that is mutable."""
    if module.is_mutable_collection(RESIDUAL) and not module.is_initializing():
        module.sow(RESIDUAL, name, x)
    return x


class EncoderBlock(nn.Module):
    """Block ``index`` of the encoder, with the norm placement chosen in the spec."""

    spec: ViTSpec
    index: int
    grid: tuple[int, int]
    num_prefix_tokens: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, capture: bool = False,
                 step: jax.Array | None = None) -> jax.Array:
        rate = drop_path_rate(self.spec.stochastic_depth, self.index, self.spec.depth)
        return self._block(x, train, capture, rate, rescale_coefficient(self.index), rate != 0.0,
                           step)

    def _block(self, x: jax.Array, train: bool, capture: bool, rate: float | jax.Array,
               res_coef: float | jax.Array, dp_on: bool,
               step: jax.Array | None = None) -> jax.Array:
        """``rate`` and ``res_coef`` (drop-path rate, RescaleViT coefficient) are arrays when the
        block is one step of an ``nn.scan``; ``dp_on`` says statically whether anything drops."""
        s = self.spec
        cfg = s.block_norm(self.index)
        norm = lambda slot, y: _sown_norm(self, cfg, y, train, s, self.grid, self.num_prefix_tokens,
                                          slot, step)
        barriers = barriers_on(s.fusion_barriers)
        attn = Attention(s.num_heads, s.dtype, s.attention_dropout_rate, s.attention_impl, barriers,
                         s.qkv_bias, s.param_init, name="MultiHeadDotProductAttention_1")
        mlp = MlpBlock(s.mlp_dim, s.dtype, s.dropout_rate, s.gelu_approximate, barriers,
                       s.param_init, s.recompute == "gelu", name="MlpBlock_3")
        dropout = nn.Dropout(s.dropout_rate)
        dpath = lambda y: drop_path(self, y, rate, train, dp_on)
        branch = lambda f, y: dpath(dropout(f(y), deterministic=not train))
        # The residual stream's gradient is materialised at the block's input and after its first
        # residual add (see grad_barrier): XLA:CPU otherwise re-derives it from every block above.
        # The stream is also pinned row-major on GPU at each block's input, after its first residual
        # add and at its output (models/stream_layout.py: XLA:GPU otherwise transposes it).
        pin = lambda v: stream_layout.pin(v, s.stream_layout)  # noqa: E731
        bar = (lambda v: pin(grad_barrier(v))) if barriers else pin
        x = bar(x)
        # The stream after each residual add (before any norm of it) feeds the extra losses
        # (train/aux_losses.py); sown only when the train step asks for RESIDUAL.
        first, second = (lambda v: _sown_stream(self, "after_attention", v),
                         lambda v: _sown_stream(self, "after_mlp", v))
        if s.norm_placement == "pre":
            x = bar(first(x + branch(lambda y: attn(y, train, capture), norm("LayerNorm_0", x))))
            y = norm("LayerNorm_2", x)
        elif s.norm_placement == "post":
            x = bar(norm("LayerNorm_0", first(x + branch(lambda y: attn(y, train, capture), x))))
            return pin(norm("LayerNorm_2", second(x + branch(lambda y: mlp(y, train), x))))
        else:  # sandwich: norm before and after each branch
            a = attn(norm("LayerNorm_0", x), train, capture)
            x = bar(first(x + dpath(dropout(norm("PostNorm_attn", a), deterministic=not train))))
            m = mlp(norm("LayerNorm_2", x), train)
            return pin(second(x + dpath(dropout(norm("PostNorm_mlp", m),
                                                deterministic=not train))))
        if s.residual_scaling == "rescale":
            # RescaleViT: sqrt(i/(i+1)) * x + s/sqrt(L) * MLP(y), i 1-based, s learnable (init 1).
            scale = self.param("rescale_s", nn.initializers.ones, (), jnp.float32)
            return pin(second(res_coef * x + (scale / math.sqrt(s.depth)).astype(x.dtype)
                              * branch(lambda z: mlp(z, train), y)))
        return pin(second(x + branch(lambda z: mlp(z, train), y)))


class _ScannedBlock(EncoderBlock):
    """Blocks 0..scan_length-1 as the body of ``nn.scan``: (carry, per-block constants) ->
    (carry, None). train/capture are attributes (static), not scanned arguments."""

    scan_train: bool = False
    scan_capture: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, consts: Mapping[str, jax.Array]) -> tuple[jax.Array, None]:
        s = self.spec
        dp_on = s.stochastic_depth != 0.0 and s.scan_length > 1  # any scanned block drops
        return self._block(x, self.scan_train, self.scan_capture, consts["drop_path_rate"],
                           consts["res_coef"], dp_on, consts.get("step")), None


class ViT(nn.Module):
    """ViT classifier. ``apply(variables, images, train=..., capture=...)`` -> logits (float32).

    With ``capture=True`` and ``mutable=['intermediates']`` the attention weights of every block
    and the token statistics before/after each norm slot are recorded; never in training by default.
    """

    spec_class: ClassVar[type] = ViTSpec
    spec: ViTSpec

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False, capture: bool = False,
                 step: jax.Array | None = None) -> jax.Array:
        """``step``: the global train step (int scalar), read by norms whose function depends on
        it (norms/progressive.py); the train and eval steps pass ``state.step``."""
        s = self.spec
        if s.num_classes is None:
            raise ValueError("the ViTSpec has no num_classes: build it with ViTSpec.from_config("
                             "model_config, num_classes)")
        grid = s.grid(images.shape[1:3])
        google = s.param_init == "google"
        x = self.tokens(images.astype(s.dtype), train, step)
        cls = None
        if s.uses_cls:
            # timm 0.3 (DeiT) and T2T-ViT: trunc_normal_(std=.02); Google: zeros
            cls = self.param("cls", nn.initializers.zeros if google else timm_normal(),
                             (1, 1, s.hidden_size), jnp.float32)
            cls = jnp.tile(cls.astype(s.dtype), (x.shape[0], 1, 1))
        joins_late = s.uses_cls and s.cls_token_at_block > 0
        if s.uses_cls and not joins_late:
            x = jnp.concatenate([cls, x], axis=1)
        x = Encoder(s, grid, int(s.uses_cls and not joins_late), name="Transformer")(
            x, cls, train, capture, step)
        if s.classifier == "token":
            x = x[:, 0]
        else:  # timm's avg pool: the patch tokens only; a class token (always at 0) is left out
            x = jnp.mean(x[:, int(s.uses_cls):], axis=1)
        if s.final_norm and s.fc_norm:
            # timm's global_pool='avg' with fc_norm: pool the tokens, then normalise that one vector
            # (the final norm's config, in slot 'fc_norm'); the encoder has no final norm then.
            x = _sown_norm(self, s.final_norm_config(), x[:, None, :], train, s, grid, 0, FC_SLOT,
                           step)[:, 0]
        if s.representation_size:
            x = jnp.tanh(nn.Dense(s.representation_size, dtype=s.dtype, param_dtype=jnp.float32,
                                  kernel_init=nn.initializers.lecun_normal() if google else timm_normal(),
                                  name="pre_logits")(x))
        logits = nn.Dense(s.num_classes, dtype=s.dtype, param_dtype=jnp.float32,
                          kernel_init=nn.initializers.zeros if google else timm_normal(),
                          name="head")(x)
        return logits.astype(jnp.float32)

    def tokens(self, images: jax.Array, train: bool, step: jax.Array | None = None) -> jax.Array:
        """The stem: images (B, H, W, C) -> patch tokens (B, rows*cols, hidden_size). A family
        with another stem overrides this (models/t2t_vit.py) and passes ``step`` to its norms."""
        s = self.spec
        x = PatchEmbed(s.patch_size, s.hidden_size, s.patch_norm, s.dtype, s.param_init,
                       name="embedding")(images)
        if s.patch_norm in ("post", "dual"):
            x = norms.create(DEFAULT_NORM, dim=s.hidden_size, name="patch_norm_post")(x)
        return x


class Encoder(nn.Module):
    """Position embedding, the blocks and the final norm (Google's 'Transformer' scope)."""

    spec: ViTSpec
    grid: tuple[int, int]
    with_prefix: int

    @nn.compact
    def __call__(self, x: jax.Array, cls: jax.Array | None, train: bool,
                 capture: bool, step: jax.Array | None = None) -> jax.Array:
        s = self.spec
        if s.posemb == "learn":
            x = AddPositionEmbs(name="posembed_input")(x)
        elif s.posemb == "sincos2d":
            pe = jnp.asarray(sincos_2d(self.grid, s.hidden_size), x.dtype)
            if self.with_prefix:
                pe = jnp.concatenate([jnp.zeros((1, self.with_prefix, s.hidden_size), x.dtype), pe], 1)
            x = x + pe
        elif s.posemb == "sincos1d":  # one table over the sequence, class token at position 0
            x = x + jnp.asarray(sincos_1d(x.shape[1], s.hidden_size), x.dtype)
        if s.patch_norm == "post_posemb":
            x = norms.create(DEFAULT_NORM, dim=s.hidden_size, name="patch_norm_post")(x)
        x = nn.Dropout(s.dropout_rate)(x, deterministic=not train)
        prefix = self.with_prefix
        start = 0
        if s.scan:
            # Blocks 0..k-1 are identical but for their drop-path rate and RescaleViT coefficient,
            # which enter as scanned arrays: one block is traced and compiled instead of k.
            k = s.scan_length
            body = nn.remat(_ScannedBlock, prevent_cse=False) if s.remat else _ScannedBlock
            scanned = nn.scan(body, variable_axes={"params": 0, "batch_stats": 0, "intermediates": 0,
                                                  "schedule": 0, RESIDUAL: 0, ATTENTION_MAX: 0},
                              split_rngs={"params": True, "dropout": True}, in_axes=0, length=k)
            consts = {
                "drop_path_rate": np.asarray([drop_path_rate(s.stochastic_depth, i, s.depth)
                                              for i in range(k)], np.float32),
                "res_coef": np.asarray([rescale_coefficient(i) for i in range(k)], np.float32),
            }
            if step is not None:
                consts["step"] = jnp.broadcast_to(jnp.asarray(step), (k,))
            x, _ = scanned(s, 0, self.grid, prefix, scan_train=train, scan_capture=capture,
                           name="encoderblock")(x, consts)
            start = k
        block_cls = nn.remat(EncoderBlock, static_argnums=(2, 3)) if s.remat else EncoderBlock
        for i in range(start, s.depth):
            if cls is not None and s.cls_token_at_block == i and i > 0:
                x = jnp.concatenate([cls, x], axis=1)
                prefix = 1
            x = block_cls(s, i, self.grid, prefix, name=f"encoderblock_{i}")(x, train, capture, step)
        if cls is not None and s.cls_token_at_block >= s.depth:
            x = jnp.concatenate([cls, x], axis=1)
            prefix = 1
        if s.final_norm and not s.fc_norm:
            x = _sown_norm(self, s.final_norm_config(), x, train, s, self.grid, prefix, FINAL_SLOT,
                           step)
        return x

"""padded_dot_product_attention equals unpadded attention: values and gradients against a float64
numpy reference (the softmax formula and its hand-derived backward) on random inputs, XLA's
implementation on CPU. Tolerances: float32 computation vs float64 reference, rtol=atol=1e-5.
On GPU the model uses the same function with implementation='cudnn' (not testable here)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax.models import padded_attention as pa

pytestmark = pytest.mark.usefixtures("float32_matmuls")


def _ref(q, k, v, scale):
    """Attention in float64: (B,T,H,D) -> out, and the backward of sum(out * g)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v), p


def _ref_grads(q, k, v, g, scale):
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    _, p = _ref(q, k, v, scale)
    dv = np.einsum("bhts,bthd->bshd", p, g)
    dp = np.einsum("bthd,bshd->bhts", g, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, k) * scale
    dk = np.einsum("bhts,bthd->bshd", ds, q) * scale
    return dq, dk, dv


def _inputs(b, t, s, h, d, seed=0):
    r = np.random.default_rng(seed)
    q = r.normal(size=(b, t, h, d)).astype(np.float32)
    k = r.normal(size=(b, s, h, d)).astype(np.float32)
    v = r.normal(size=(b, s, h, d)).astype(np.float32)
    g = r.normal(size=(b, t, h, d)).astype(np.float32)
    return q, k, v, g


@pytest.mark.parametrize("t,s,multiple,impl", [
    (197, 197, 16, "xla"),  # ViT-B/16's tokens -> 208
    (65, 65, 16, None),     # ViT-Ti/4 on 32x32 -> 80
    (17, 11, 8, "xla"),     # cross attention, both axes padded
    (32, 32, 16, None),     # a multiple already: no padding
])
def test_values_and_gradients_equal_unpadded_attention(t, s, multiple, impl):
    b, h, d = 2, 3, 16
    q, k, v, g = _inputs(b, t, s, h, d)
    scale = 1 / np.sqrt(d)

    def loss(q, k, v):
        out = pa.padded_dot_product_attention(q, k, v, multiple=multiple, implementation=impl)
        return jnp.sum(out * g), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.shape == (b, t, h, d)
    want, _ = _ref(q, k, v, scale)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, _ref_grads(q, k, v, g, scale)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_padded_rows_never_change_the_outputs():
    """Whatever the padded keys/values/queries hold (here large random values), the true rows are
    the unpadded attention's and the padded query rows are zeros: the premise the padding rests on."""
    b, t, h, d, tp = 2, 13, 2, 8, 16
    q, k, v, _ = _inputs(b, t, t, h, d, seed=1)
    junk = np.random.default_rng(2).normal(scale=50.0, size=(3, b, tp - t, h, d)).astype(np.float32)
    qp, kp, vp = (np.concatenate([x, j], axis=1) for x, j in zip((q, k, v), junk))
    lengths = jnp.full((b,), t, jnp.int32)
    out = jax.nn.dot_product_attention(qp, kp, vp, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation="xla")
    want, _ = _ref(q, k, v, 1 / np.sqrt(d))
    np.testing.assert_allclose(out[:, :t], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, t:], 0.0)


def test_bfloat16_matches_the_reference_at_bfloat16_precision():
    b, t, h, d = 2, 197, 2, 32
    q, k, v, _ = _inputs(b, t, t, h, d, seed=3)
    out = pa.padded_dot_product_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    want, _ = _ref(q, k, v, 1 / np.sqrt(d))
    # bfloat16 inputs and output: 8-bit mantissa, relative error ~4e-3 per rounding.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=3e-2, atol=3e-2)


def test_padded_length_and_implementation_choice():
    assert [pa.padded_length(n, 16) for n in (1, 16, 17, 197, 208)] == [16, 16, 32, 208, 208]
    with pytest.raises(ValueError, match="multiple"):
        pa.padded_length(5, 0)
    assert pa.choose_implementation(jnp.bfloat16, "gpu") == "cudnn"
    assert pa.choose_implementation(jnp.float16, "gpu") == "cudnn"
    assert pa.choose_implementation(jnp.float32, "gpu") is None
    assert pa.choose_implementation(jnp.bfloat16, "cpu") is None
    assert pa.choose_implementation(jnp.bfloat16, "tpu") is None


def test_float32_matmuls_fixture_holds_inside_the_tests():
    assert jax.config.jax_default_matmul_precision == "float32"


def test_model_through_the_padded_path_gives_the_unpadded_logits(monkeypatch):
    """The model's GPU path (layers.sdpa -> padded attention) run on CPU with XLA's kernel: the
    padded tokens never change a logit or a gradient (50 tokens padded to 64). Tolerance 1e-5:
    the same float32 arithmetic but for the masked softmax's reduction order."""
    from normvit_jax import models
    from normvit_jax.models import layers

    spec = models.spec_of({"patch_size": 4, "hidden_size": 32, "depth": 2, "num_heads": 4,
                           "mlp_dim": 64, "attention_impl": "fused_sdpa"}, num_classes=5)
    model = models.create(spec)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 28, 28, 3)), jnp.float32)
    variables = jax.jit(lambda k: model.init(k, x, train=False))(jax.random.key(0))
    loss = lambda v: jnp.sum(jnp.sin(model.apply(v, x, train=False)))
    # jitted: op by op, a GPU compiles every primitive on its own (34 s of `pytest -m gpu`);
    # each jax.jit object traces anew, so the second one sees the patched attention
    want, want_g = jax.jit(jax.value_and_grad(loss))(variables)
    calls = []

    def padded(q, k, v, **kw):
        calls.append(q.shape)
        return pa.padded_dot_product_attention(q, k, v, **kw)

    monkeypatch.setattr(layers.padded_attention, "choose_implementation", lambda dtype: "xla")
    monkeypatch.setattr(layers.padded_attention, "padded_dot_product_attention", padded)
    got, got_g = jax.jit(jax.value_and_grad(loss))(variables)
    assert calls and all(shape[1] == 50 for shape in calls)  # 7x7 patches + class token
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

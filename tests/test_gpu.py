"""What differs on a GPU, for ``pytest -m gpu`` (tests/conftest.py adds the other files of the
selection): TF32 products, cuDNN's fused attention with padded tokens (values, gradients, and that
the model's bfloat16 step really calls it), a bfloat16 model against float32, and a short
training run of the train loop. Every test runs on CPU too and adapts to the backend it finds:
the implementation (cuDNN on GPU, XLA elsewhere) and the tolerance (TF32 or bfloat16 where the GPU
computes in them)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models
from normvit_jax.models import padded_attention as pa

pytestmark = pytest.mark.gpu
ON_GPU = jax.default_backend() == "gpu"
BF16 = 2.0 ** -8  # bfloat16's unit roundoff (8-bit mantissa)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def test_float32_products_in_tf32_by_default_and_full_float32_on_request():
    """XLA's default precision runs float32 dots in TF32 on Ampere and later GPUs (10-bit
    mantissa, ~1e-3 relative error at K=512); ``jax.default_matmul_precision('float32')`` (the
    tests' ``float32_matmuls`` fixture) gives float32's ~1e-6. On CPU both are float32."""
    r = np.random.default_rng(0)
    a, b = (r.normal(size=(256, 512)).astype(np.float32), r.normal(size=(512, 256)).astype(np.float32))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    default = rel_err(jax.jit(jnp.matmul)(a, b), ref)
    with jax.default_matmul_precision("float32"):
        full = rel_err(jax.jit(lambda x, y: x @ y)(a, b), ref)
    assert full < 1e-5, full
    assert default < (1e-2 if ON_GPU else 1e-5), default


def _attention_inputs(b=2, t=197, h=2, d=64, seed=0):
    r = np.random.default_rng(seed)
    return [r.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(4)]  # q, k, v, g


def _ref_attention(q, k, v):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def test_padded_attention_in_bfloat16_on_the_backends_kernel():
    """ViT-B/16's 197 tokens (padded to 208), head width 64, bfloat16: cuDNN's fused attention on
    GPU (its custom call is in the compiled step), XLA's on CPU. Values against float64 and
    gradients against float32 XLA attention on the same inputs, at bfloat16 tolerance (a few
    roundings of 2^-8 relative)."""
    impl = pa.choose_implementation(jnp.bfloat16)
    assert impl == ("cudnn" if ON_GPU else None)
    q, k, v, g = _attention_inputs()

    def loss(q, k, v, impl):
        out = pa.padded_dot_product_attention(q, k, v, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * g), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    half = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: grad(q, k, v, impl))
    if ON_GPU:
        assert "__cudnn$fmha" in f.lower(*half).as_text()
    (_, out), grads = f(*half)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert rel_err(out, _ref_attention(q, k, v)) < 8 * BF16
    with jax.default_matmul_precision("float32"):
        _, want = jax.jit(lambda q, k, v: grad(q, k, v, "xla"))(q, k, v)
    for got, ref in zip(grads, want):
        assert rel_err(got, ref) < 16 * BF16


def _small_vit(dtype):
    return models.create({"patch_size": 16, "hidden_size": 128, "depth": 2, "num_heads": 2,
                          "mlp_dim": 256, "attention_impl": "auto"}, num_classes=10, dtype=dtype)


def test_bfloat16_model_uses_the_gpu_attention_and_matches_float32():
    """A 2-block ViT at 224 px (197 tokens, head width 64): in bfloat16 on GPU its attention is
    cuDNN's (no silent fallback to XLA's), and its logits and gradients stay within bfloat16
    tolerance of the float32 model with the same parameters."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 224, 224, 3)), jnp.float32)
    f32, b16 = _small_vit(jnp.float32), _small_vit(jnp.bfloat16)
    variables = jax.jit(lambda k: f32.init(k, x, train=False))(jax.random.key(0))
    r = np.random.default_rng(2)  # Google's init zeroes the head: give every weight a value
    variables = jax.tree.map(lambda a: a + 0.05 * r.normal(size=a.shape).astype(np.float32),
                             variables)

    def loss(model):  # (the loss, the logits): one compiled program per model (GPU test time)
        def f(v):
            logits = model.apply(v, x, train=False).astype(jnp.float32)
            return jnp.sum(jnp.sin(logits)), logits
        return f

    step = jax.jit(jax.value_and_grad(loss(b16), has_aux=True))
    if ON_GPU:
        assert "__cudnn$fmha" in step.lower(variables).as_text()
    (got, got_logits), got_g = step(variables)
    with jax.default_matmul_precision("float32"):
        (want, want_logits), want_g = jax.jit(jax.value_and_grad(loss(f32), has_aux=True))(variables)
    assert rel_err(got_logits, want_logits) < 0.05  # two blocks of bfloat16 activations
    assert abs(float(got) - float(want)) < 0.05 * max(1.0, abs(float(want)))
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float32)) for a in jax.tree.leaves(t)])
    assert rel_err(flat(got_g), flat(want_g)) < 0.1


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_dtn_layer_in_bfloat16_against_float32(kernel):
    """DTN, the norm with its own matrix products (token statistics), at S/16's activation shape:
    the bfloat16 layer on this backend against the float32 layer at full precision on the same
    (bfloat16-rounded) input, forward and input gradient, with channel means ~10x their spread
    (the cancellation its variance must survive). Bound: bfloat16's output rounding plus the
    statistics' error, relative to the largest value. kernel='pallas': the forward and backward
    as Triton kernels on a GPU (Pallas's interpreter on CPU), the same bounds."""
    from normvit_jax import norms
    b, t, c, heads = 2, 197, 384, 6
    layer = norms.create({"name": "dtn", "kernel": kernel}, dim=c, num_heads=heads, grid=(14, 14),
                         num_prefix_tokens=1, slot="block")
    reference = norms.create({"name": "dtn"}, dim=c, num_heads=heads, grid=(14, 14),
                             num_prefix_tokens=1, slot="block")
    r = np.random.default_rng(2)
    x = (r.normal(size=(b, t, c)) + 10.0 * r.normal(size=(1, 1, c))).astype(np.float32)
    g = r.normal(size=(b, t, c)).astype(np.float32)
    variables = jax.jit(lambda k: reference.init(k, x, train=False))(jax.random.key(0))

    def fwd_grad(module, xx):
        def loss(xx):
            y = module.apply(variables, xx, train=False)
            return jnp.sum(y.astype(jnp.float32) * g), y
        return jax.grad(loss, has_aux=True)(xx)

    xb = jnp.asarray(x, jnp.bfloat16)  # the reference takes the same (rounded) input
    dx, y = jax.jit(lambda xx: fwd_grad(layer, xx))(xb)
    with jax.default_matmul_precision("float32"):  # float32: XLA's path (kernel='pallas' is half)
        dx_ref, y_ref = jax.jit(lambda xx: fwd_grad(reference, xx))(xb.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, y_ref) < 0.05
    assert rel_err(dx, dx_ref) < 0.1


def test_short_training_run(tmp_path):
    """The train loop end to end for a few steps (digits demo, tiny ViT): losses finite, the
    eval runs, a checkpoint is written; no TensorFlow needed (the GPU hosts have none)."""
    from normvit_jax.train import loop
    from tests.conftest import tiny_demo_config
    cfg = tiny_demo_config(total_steps=4, eval_every=4, checkpoint_every=4)
    out = loop.train_and_evaluate(cfg, str(tmp_path))
    assert out["step"] == 4
    assert np.isfinite(out["eval"]["loss"]) and out["eval"]["num_examples"] == 355
    assert (tmp_path / "checkpoints").exists()

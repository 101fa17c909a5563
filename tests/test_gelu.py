"""models/gelu.py: the MLP's GELU whose backward keeps only its input."""
from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from normvit_jax import models
from normvit_jax.models.gelu import gelu
from normvit_jax.models.layers import MlpBlock


def _reference(x: np.ndarray, approximate: bool) -> tuple[np.ndarray, np.ndarray]:
    """GELU and its derivative in float64 from the published formulas (Hendrycks & Gimpel)."""
    if approximate:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2)
        return 0.5 * x * (1 + t), d
    erf = np.vectorize(math.erf)
    cdf = 0.5 * (1 + erf(x / math.sqrt(2)))
    return x * cdf, cdf + x * np.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("approximate", [True, False])
def test_values_and_gradient_are_the_published_ones(approximate):
    x = np.random.default_rng(0).normal(0, 3, (4, 33, 64)).astype(np.float32)
    g = np.random.default_rng(1).normal(0, 1, x.shape).astype(np.float32)
    y, vjp = jax.vjp(lambda a: gelu(a, approximate), jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(g))
    want_y, want_d = _reference(x.astype(np.float64), approximate)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    # float32 against float64: where tanh is within float32 rounding of +-1, 1 - t**2 keeps
    # few bits (inputs up to 12 here); 5e-5 of gradients of size ~1
    np.testing.assert_allclose(dx, want_d * g, rtol=1e-5, atol=5e-5)
    # and exactly jax.nn.gelu's forward, its autodiff gradient to float32 rounding
    auto_y, auto_vjp = jax.vjp(lambda a: jax.nn.gelu(a, approximate=approximate), jnp.asarray(x))
    np.testing.assert_array_equal(y, auto_y)
    np.testing.assert_allclose(dx, auto_vjp(jnp.asarray(g))[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("approximate", [True, False])
def test_the_mlp_saves_two_hidden_sized_tensors_for_its_backward(approximate):
    """The MLP's backward keeps the first matmul's output (the GELU's input) and the GELU's output
    (the second matmul's input): autodiff of jax.nn.gelu kept 4 (tanh form) or 3 (erf form)
    more of that size."""
    b, t, d, hidden = 2, 5, 8, 32
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    mlp = MlpBlock(hidden, jnp.float32, gelu_approximate=approximate)
    params = mlp.init(jax.random.key(1), x, train=False)
    loss = lambda p: jnp.sum(jnp.sin(mlp.apply(p, x, train=True)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params)
    shapes = [tuple(int(n) for n in s.split(",") if n)
              for s in re.findall(r"^f32\[([\d,]*)\]", out.getvalue(), re.M)]
    assert len([s for s in shapes if math.prod(s) == b * t * hidden]) == 2, out.getvalue()
    # training and inference compute the same MLP
    np.testing.assert_array_equal(mlp.apply(params, x, train=True),
                                  mlp.apply(params, x, train=False))


def test_model_gradients_equal_autodiff_of_the_plain_gelu(monkeypatch):
    """A whole ViT's parameter gradients with this GELU and with jax.nn.gelu's autodiff."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                           "mlp_dim": 64}, num_classes=4)
    variables = model.init(jax.random.key(1), x)
    loss = lambda v: jnp.sum(jnp.sin(model.apply(v, x, train=True)))
    grads = lambda: jax.jit(jax.grad(loss))(variables)  # traced anew: the patch applies
    ours = grads()
    monkeypatch.setattr("normvit_jax.models.layers.gelu",
                        lambda h, approximate: jax.nn.gelu(h, approximate=approximate))
    plain = grads()
    assert float(max(jnp.abs(a).max() for a in jax.tree.leaves(ours))) > 1e-3
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _hidden_sized_residuals(fn, *args, size: int) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    shapes = [tuple(int(n) for n in s.split(",") if n)
              for s in re.findall(r"^\w+\[([\d,]*)\]", out.getvalue(), re.M)]
    return len([s for s in shapes if math.prod(s) == size])


@pytest.mark.parametrize("barriers", [False, True])
def test_recompute_gelu_keeps_one_hidden_sized_tensor_and_computes_the_same(barriers):
    """model.recompute='gelu': the MLP's backward keeps only the GELU's input (1 hidden-sized
    residual, 2 without) and recomputes the GELU's output; outputs and gradients equal the plain
    MLP's (the same operations, recomputed), with and without the CPU fusion barriers."""
    b, t, d, hidden = 2, 5, 8, 32
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    cot = jax.random.normal(jax.random.key(2), (b, t, d))
    runs = {}
    for rec in (False, True):
        mlp = MlpBlock(hidden, jnp.float32, barriers=barriers, recompute_gelu=rec)
        params = mlp.init(jax.random.key(1), x, train=False)
        loss = lambda p, xx, m=mlp: jnp.sum(jnp.sin(m.apply(p, xx, train=True)) * cot)
        runs[rec] = (jax.jit(loss)(params, x), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x),
                     _hidden_sized_residuals(loss, params, x, size=b * t * hidden))
    assert runs[False][2] == 2 and runs[True][2] == 1, runs
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-6)
    assert float(max(jnp.abs(a).max() for a in jax.tree.leaves(runs[False][1]))) > 1e-2
    for a, c in zip(jax.tree.leaves(runs[True][1]), jax.tree.leaves(runs[False][1])):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", [{}, {"scan": True}, {"norm_placement": "post"}])
def test_recompute_gelu_in_a_vit_and_its_bad_settings(layout):
    """A ViT with model.recompute='gelu' (a BatchNorm in its slots: state updated alike; blocks
    unrolled or under nn.scan, pre- or post-norm) trains to the same loss, gradients and
    statistics; with MLP dropout or an unknown value it is refused."""
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    cfg = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2, "mlp_dim": 64,
           "fusion_barriers": "off", "norm": {"name": "batchnorm"}, **layout}
    res = {}
    for rec in ("none", "gelu"):
        model = models.create({**cfg, "recompute": rec}, num_classes=4)
        variables = model.init(jax.random.key(1), x)

        def loss(p, m=model, v=variables):
            y, upd = m.apply({**v, "params": p}, x, train=True, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y)), upd
        (val, upd), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
        res[rec] = (val, g, upd)
    np.testing.assert_allclose(res["gelu"][0], res["none"][0], rtol=1e-6)
    for a, c in zip(jax.tree.leaves(res["gelu"][1:]), jax.tree.leaves(res["none"][1:])):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"model.recompute='gelu'.*dropout_rate=0.1"):
        models.create({**cfg, "recompute": "gelu", "dropout_rate": 0.1}, num_classes=4)
    with pytest.raises(ValueError, match=r"model.recompute='all' is not accepted; accepted: \['none', 'gelu'\]"):
        models.create({**cfg, "recompute": "all"}, num_classes=4)


def test_xla_keeps_the_backwards_tanh_apart_from_the_forwards():
    """The backward's tanh is its own: XLA's CSE merged it with the forward's (the same function of
    the same input) and so kept the tanh (B, T, mlp_dim) from the forward to the backward, the
    tensor this GELU exists not to keep (XLA:GPU's buffer assignment of a B/16 step: 3.5 GiB,
    docs/benchmarks.md). Counted in the optimized module of the forward and its gradient: two
    tanh, one each way (one when merged)."""
    h = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(lambda a: jnp.sum(gelu(a, True) * 3.0)))
    text = step.lower(h).compile().as_text()
    assert len(re.findall(r" tanh\(", text)) == 2, text


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu_bias_is_gelu_of_the_sum_and_keeps_the_matmul_output(approximate):
    """gelu_bias(z, b) = jax.nn.gelu(z + b): values exactly, gradients of z and b as autodiff's
    (float32, 1e-6 relative); its backward keeps z (not z + b) and the bias; XLA keeps the
    backward's tanh apart from the forward's (two tanh, as for ``gelu``)."""
    from normvit_jax.models.gelu import gelu_bias
    r = np.random.default_rng(5)
    z = jnp.asarray(r.normal(0, 3, (4, 9, 32)), jnp.float32)
    bias = jnp.asarray(r.normal(0, 1, (32,)), jnp.float32)
    g = jnp.asarray(r.normal(0, 1, z.shape), jnp.float32)
    plain = lambda a, c: jax.nn.gelu(a + c, approximate=approximate)  # noqa: E731
    y, vjp = jax.vjp(lambda a, c: gelu_bias(a, c, approximate), z, bias)
    want_y, want_vjp = jax.vjp(plain, z, bias)
    np.testing.assert_array_equal(y, want_y)
    for got, want in zip(vjp(g), want_vjp(g)):
        assert float(jnp.max(jnp.abs(want))) > 1e-2
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda a, c: jnp.sum(gelu_bias(a, c, approximate)), z, bias)
    assert [line.split()[0] for line in out.getvalue().strip().splitlines()] == [
        "f32[4,9,32]", "f32[32]"] and "argument" in out.getvalue(), out.getvalue()
    if approximate:
        step = jax.jit(jax.value_and_grad(lambda a: jnp.sum(gelu_bias(a, bias, True) * 3.0)))
        assert len(re.findall(r" tanh\(", step.lower(z).compile().as_text())) == 2


def test_the_mlp_without_cpu_barriers_adds_the_bias_in_the_gelu_and_computes_the_same():
    """MlpBlock with the fusion barriers off (the GPU/TPU default) runs gelu_bias: the training
    output equals the inference output (the plain path), and its gradients equal those of the
    plain MLP written out here (float32, 1e-5)."""
    b, t, d, hidden = 2, 5, 8, 32
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    cot = jax.random.normal(jax.random.key(2), (b, t, d))
    mlp = MlpBlock(hidden, jnp.float32, barriers=False)
    params = mlp.init(jax.random.key(1), x, train=False)
    calls = []
    import normvit_jax.models.layers as layers
    real = layers.gelu_bias
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers, "gelu_bias", lambda *a: calls.append(1) or real(*a))
        train = mlp.apply(params, x, train=True)
    assert calls
    np.testing.assert_allclose(train, mlp.apply(params, x, train=False), rtol=1e-6, atol=1e-6)

    def written(p, xx):
        q = p["params"]
        h = jax.nn.gelu(xx @ q["Dense_0"]["kernel"] + q["Dense_0"]["bias"], approximate=True)
        return jnp.sum((h @ q["Dense_1"]["kernel"] + q["Dense_1"]["bias"]) * cot)
    got = jax.grad(lambda p, xx: jnp.sum(mlp.apply(p, xx, train=True) * cot), (0, 1))(params, x)
    want = jax.grad(written, (0, 1))(params, x)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(c))) > 1e-3
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_gelu_bias_backward_keeps_one_barrier_on_the_matmul_output():
    """gelu_bias's backward puts one barrier, on z, and adds the bias after it: a second barrier
    on z + bias (its backward calling gelu's, b75312d) made XLA:GPU write z + bias out for the
    backward, 310 MB a B/16 block (benchmarks.gpu_hlo: 63.5 -> 66.9 GB a step). Its gradients
    are jax.nn.gelu's autodiff ones."""
    from normvit_jax.models.gelu import gelu_bias
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(0, 2, (6, 32)), jnp.float32)
    b = jnp.asarray(rng.normal(0, 1, (32,)), jnp.float32)
    loss = lambda f: lambda zz, bb: jnp.sum(jnp.sin(f(zz, bb)))  # noqa: E731
    grad = jax.grad(loss(gelu_bias), argnums=(0, 1))
    assert str(jax.make_jaxpr(grad)(z, b)).count("optimization_barrier") == 1
    plain = jax.grad(loss(lambda zz, bb: jax.nn.gelu(zz + bb)), argnums=(0, 1))(z, b)
    for got, want in zip(grad(z, b), plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

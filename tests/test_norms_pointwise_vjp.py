"""norms/pointwise.py: DyT and Derf in half precision train through ``pointwise_affine``, whose
backward keeps the input alone (autodiff kept tanh's / erf's float32 output for the scale's
gradient: +1.8 GiB at S/16). Checked: values and every gradient equal autodiff of the formula on
the same bfloat16 input (same function, recomputed: float32 products, bfloat16 dx), the saved
residuals, and that XLA keeps the backward's tanh apart from the forward's."""
from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from normvit_jax import norms


@pytest.mark.parametrize("name", ["dyt", "derf"])
def test_half_precision_training_path_is_the_formula_and_keeps_the_input(name):
    layer = norms.create({"name": name}, dim=32, num_heads=4, grid=(2, 2), num_prefix_tokens=1,
                         slot="block")
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(0, 2, (3, 5, 32)), jnp.bfloat16)
    g = jnp.asarray(r.normal(size=(3, 5, 32)), jnp.float32)
    variables = layer.init(jax.random.key(0), x)
    params = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(r.normal(size=a.shape), a.dtype),
                          variables["params"])

    def formula(pp, xx):
        q = [pp["alpha"]] + ([pp["shift"]] if name == "derf" else [])
        f = jnp.tanh(q[0] * xx.astype(jnp.float32)) if name == "dyt" else jax.scipy.special.erf(
            q[0] * xx.astype(jnp.float32) + q[1])
        return (f * pp["scale"] + pp["bias"]).astype(xx.dtype)

    ours = lambda pp, xx: layer.apply({"params": pp}, xx, train=True)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(ours(params, x), np.float32),
                                  np.asarray(formula(params, x), np.float32))
    np.testing.assert_array_equal(np.asarray(ours(params, x), np.float32),
                                  np.asarray(layer.apply({"params": params}, x), np.float32))
    loss = lambda f: (lambda pp, xx: jnp.sum(f(pp, xx).astype(jnp.float32) * g))  # noqa: E731
    got = jax.grad(loss(ours), (0, 1))(params, x)
    want = jax.grad(loss(formula), (0, 1))(params, x)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(c.astype(jnp.float32)))) > 1e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                   rtol=1e-5, atol=1e-5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss(ours), params, x)
    saved = [line for line in out.getvalue().strip().splitlines()
             if "from a constant" not in line]  # the loss's own cotangent g
    assert sorted(line.split()[0] for line in saved if "[3,5,32]" in line) == [
        "bf16[3,5,32]"], out.getvalue()


def test_xla_keeps_the_backwards_tanh_apart_from_the_forwards():
    layer = norms.create({"name": "dyt"}, dim=32, num_heads=4, grid=(2, 2), num_prefix_tokens=1,
                         slot="block")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 32)), jnp.bfloat16)
    params = layer.init(jax.random.key(0), x)["params"]
    step = jax.jit(jax.value_and_grad(lambda pp, xx: jnp.sum(
        layer.apply({"params": pp}, xx, train=True).astype(jnp.float32)), argnums=(0, 1)))
    text = step.lower(params, x).compile().as_text()
    assert len(re.findall(r" tanh\(", text)) == 2, text

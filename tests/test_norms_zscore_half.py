"""norms/feature.py: z-score trains in half precision through LayerNorm's written-out backward
with ddof 1 (layernorm.standardise), which keeps the input and two numbers a token. Checked
against the formula (the unbiased per-token variance, the seed's) on the same bfloat16 input:
values at bfloat16 rounding, every gradient within 1e-2 of its largest value, and the saved
residuals."""
from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from normvit_jax import norms


@pytest.mark.parametrize("affine", [True, False])
def test_half_precision_zscore_is_the_unbiased_formula(affine):
    layer = norms.create({"name": "zscore", "affine": affine}, dim=32, num_heads=4, grid=(2, 2),
                         num_prefix_tokens=1, slot="block")
    r = np.random.default_rng(0)
    # channel means 10x the spread: the cancellation the statistics must survive
    x = jnp.asarray(r.normal(size=(3, 5, 32)) + 10 * r.normal(size=32), jnp.bfloat16)
    g = jnp.asarray(r.normal(size=(3, 5, 32)), jnp.float32)
    params = layer.init(jax.random.key(0), x).get("params", {})
    params = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(r.normal(size=a.shape), a.dtype), params)

    def formula(pp, xx):
        x32 = xx.astype(jnp.float32)
        y = (x32 - x32.mean(-1, keepdims=True)) / jnp.sqrt(x32.var(-1, ddof=1, keepdims=True)
                                                            + 1e-6)
        return (y * pp["scale"] + pp["bias"] if affine else y).astype(xx.dtype)

    ours = lambda pp, xx: layer.apply({"params": pp} if pp else {}, xx, train=True)  # noqa: E731
    y, want_y = ours(params, x), formula(params, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32),
                               rtol=1e-2, atol=1e-2)
    loss = lambda f: (lambda pp, xx: jnp.sum(f(pp, xx).astype(jnp.float32) * g))  # noqa: E731
    got = jax.grad(loss(ours), (0, 1))(params, x)
    want = jax.grad(loss(formula), (0, 1))(params, x)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.abs(c).max() > 1e-2
        assert np.abs(a - c).max() <= 1e-2 * np.abs(c).max(), (np.abs(a - c).max(), np.abs(c).max())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss(ours), params, x)
    big = [line.split()[0] for line in out.getvalue().strip().splitlines()
           if "[3,5,32]" in line and "from a constant" not in line]
    assert big == ["bf16[3,5,32]"], out.getvalue()

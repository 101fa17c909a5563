"""DTN against a float64 numpy transcription of the reference's computation (written here):
forward and finite-difference gradients, class-token handling, dtn_var, the reference's pooling
for grids that are multiples of 14, exact statistics otherwise, the position-map inits, and the
structure (P once per call, one batched contraction for the IN statistics)."""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shared helpers, package or not
from test_norms_common import (assert_rel, build, check_forward_and_grads, fast_jit, jit_init,
                               np_params, random_x, randomize)


def np_rel_indices(side: int) -> np.ndarray:
    """[source i, target j] offsets built the way the reference builds them (repeat patterns)."""
    ind = np.arange(side)[None, :] - np.arange(side)[:, None]  # ind[a, b] = b - a
    indx = np.tile(ind, (side, side))
    indy = np.repeat(np.repeat(ind, side, axis=0), side, axis=1)
    return np.stack([indx, indy, indx ** 2 + indy ** 2], axis=-1).astype(np.float64)


def np_dtn(x, p, heads, side, prefix=0, pool=None, mix_mean=True, eps=1e-5):
    b, t, c = x.shape
    ch = c // heads
    xg = x.reshape(b, t, heads, ch)
    xs = (xg / np.sqrt(np.mean(xg * xg, -1, keepdims=True) + eps)).reshape(b, t, c)
    mean_ln, var_ln = xs.mean(-1), xs.var(-1, ddof=1)  # (B, T), unbiased as the reference
    inp = xs[:, prefix:].reshape(b, side, side, c).transpose(0, 3, 1, 2)  # (B, C, side, side)
    s = side
    if pool:
        k = side // pool
        inp = inp.reshape(b, c, pool, k, pool, k).mean((3, 5))
        s = pool
    score = np.einsum("ijd,dh->hij", np_rel_indices(s), p["pos_proj"])
    score = np.exp(score - score.max(1, keepdims=True))
    score = score / score.sum(1, keepdims=True)  # softmax over the source i
    inp = inp.reshape(b, heads, ch, s * s)
    mean_in = inp @ score
    var_in = (inp * inp) @ score - mean_in ** 2
    if pool:
        up = lambda a: np.repeat(np.repeat(a.reshape(b, heads, ch, s, s), k, 3), k, 4)
        mean_in, var_in = (up(a).reshape(b, heads, ch, side * side) for a in (mean_in, var_in))
    sig = lambda a: 1 / (1 + np.exp(-a))
    lv = sig(p["var_gate"])[None, :, None, None]
    var = ((1 - lv) * var_in + lv * var_ln[:, None, None, prefix:]).reshape(b, c, -1).transpose(0, 2, 1)
    if mix_mean:
        lm = sig(p["mean_gate"])[None, :, None, None]
        mu = ((1 - lm) * mean_in + lm * mean_ln[:, None, None, prefix:]).reshape(b, c, -1)
        mu = mu.transpose(0, 2, 1)
    else:
        mu = mean_ln[:, prefix:, None]
    y = np.empty_like(xs)
    y[:, prefix:] = (xs[:, prefix:] - mu) / np.sqrt(var + eps)
    y[:, :prefix] = (xs[:, :prefix] - mean_ln[:, :prefix, None]) / np.sqrt(
        var_ln[:, :prefix, None] + eps)  # class token: plain LN statistics
    return y * p["scale"] + p["bias"]


@pytest.mark.parametrize("name,prefix,batch", [("dtn", 0, 2), ("dtn", 1, 2), ("dtn_var", 1, 1)])
def test_dtn_forward_and_grads(name, prefix, batch):
    side, heads, c = 3, 2, 8
    x = random_x((batch, prefix + side * side, c), seed=prefix + batch)
    m = build(name, {}, dim=c, heads=heads, grid=(side, side), prefix=prefix)
    check_forward_and_grads(m, lambda xx, p: np_dtn(xx, p, heads, side, prefix,
                                                    mix_mean=name == "dtn"), x)


def test_dtn_pooled_forward_and_grads():
    side, heads, c = 4, 2, 4  # pool_size 2 exercises the reference's pooling path cheaply
    x = random_x((1, 1 + side * side, c), seed=9)
    m = build("dtn", {"pool_size": 2}, dim=c, heads=heads, grid=(side, side), prefix=1)
    check_forward_and_grads(m, lambda xx, p: np_dtn(xx, p, heads, side, 1, pool=2), x)


@pytest.mark.parametrize("side,pool", [(28, 14), (16, None)])
def test_dtn_large_grids(side, pool):
    """Grid 28: the reference's average pooling to 14x14; grid 16 (crashes the reference): exact."""
    heads, c = 2, 4
    x = random_x((1, side * side, c), seed=side)
    m = build("dtn", {}, dim=c, heads=heads, grid=(side, side))
    params = randomize(jit_init(m, x)["params"])
    y = fast_jit(m.apply)({"params": params}, jnp.asarray(x))
    assert_rel(y, np_dtn(x.astype(np.float64), np_params(params), heads, side, pool=pool),
               what=f"grid {side}")
    if pool:  # pool_size=None: exact statistics on the full grid instead
        exact = build("dtn", {"pool_size": None}, dim=c, heads=heads, grid=(side, side))
        y2 = fast_jit(exact.apply)({"params": params}, jnp.asarray(x))
        assert_rel(y2, np_dtn(x.astype(np.float64), np_params(params), heads, side), what="exact")


@pytest.mark.parametrize("heads", [4, 5])
def test_dtn_local_init(heads):
    m = build("dtn", {"position_init": "local", "locality_strength": 2.0}, dim=20, heads=heads,
              grid=(3, 3))
    kernel = np.asarray(jit_init(m, jnp.ones((1, 9, 20)))["params"]["pos_proj"])
    k, center = 2, 0.5
    for h1 in range(k):
        for h2 in range(k):
            np.testing.assert_allclose(kernel[:, h1 + k * h2],
                                       2.0 * np.array([2 * (h2 - center), 2 * (h1 - center), -1]))
    if heads == 5:  # the head beyond k^2: small random weights, times the strength
        assert 0 < np.abs(kernel[:, 4]).max() < 2.0 * 0.1
    ref = build("dtn", {}, dim=20, heads=heads, grid=(3, 3))
    gates = jit_init(ref, jnp.ones((1, 9, 20)))["params"]
    assert np.abs(gates["pos_proj"]).max() < 0.1  # the released ViT's re-init: near-uniform P
    np.testing.assert_array_equal(gates["mean_gate"], 0)  # lambda = 0.5 at init
    np.testing.assert_array_equal(gates["var_gate"], 0)


@pytest.mark.parametrize("batch", [1, 4])
def test_dtn_position_map_once_per_call(batch):
    """Exactly two contractions whatever the batch: the (H, N, N) position logits, computed
    without a batch axis, and one batched einsum for all IN moments."""
    m = build("dtn", {}, dim=8, heads=2, grid=(3, 3), prefix=1)
    x = jnp.ones((batch, 10, 8))
    v = jit_init(m, x)
    jaxpr = jax.make_jaxpr(lambda xx: m.apply(v, xx))(x)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    assert dots[0].outvars[0].aval.shape == (2, 9, 9)

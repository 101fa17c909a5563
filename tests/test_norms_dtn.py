"""DTN against a float64 numpy transcription of the reference's computation (written here):
forward and finite-difference gradients, class-token handling, dtn_var, the reference's pooling
for grids that are multiples of 14, exact statistics otherwise, the position-map inits, and the
structure (P once per call, one batched contraction for the IN statistics)."""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shared helpers, package or not
from test_norms_common import (TOL, assert_rel, build, check_forward_and_grads, fast_jit, jit_init,
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
        assert_rel(y2, np_dtn(x.astype(np.float64), np_params(params), heads, side),
                   tol=logit_tolerance(params["pos_proj"], side), what="exact")


def logit_tolerance(pos_proj, side: int) -> float:
    """float32 tolerance of DTN's output when its position logits are large: a logit of size L
    is held to L * 2^-24 (half an ulp, and as much again from its three-term product), so P's
    entries, which the softmax takes from differences of logits, carry a relative error up to
    ~4 L 2^-24 whatever the summation order (the reference's float32 has it too). On a 28 x 28
    grid the d^2 offset reaches 1,458 and |L| ~240 here: ~6e-5, where the GPU measured 3.6e-5
    and the CPU 8e-6 (2026-11-27)."""
    largest = np.abs(np_rel_indices(side) @ np.asarray(pos_proj, np.float64)).max()
    return TOL + 4 * largest * 2.0 ** -24


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
    # the strength multiplies the whole matrix (docs/norms.md), the random heads too
    one = build("dtn", {"position_init": "local", "locality_strength": 1.0}, dim=20, heads=heads,
                grid=(3, 3))
    np.testing.assert_allclose(kernel, 2.0 * np.asarray(
        jit_init(one, jnp.ones((1, 9, 20)))["params"]["pos_proj"]), rtol=1e-6)
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


def _realistic_x(shape, channel_mean_scale, seed):
    """Tokens whose channel means are ``channel_mean_scale`` times their spread (as in a trained
    ViT's residual stream), rounded to bfloat16 so that both precisions see the same input."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) + channel_mean_scale * rng.normal(size=shape[-1])
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("init,mean_scale", [("reference", 0.3), ("local", 10.0)])
def test_dtn_bfloat16_against_float64(init, mean_scale):
    """The bfloat16 path (half-precision moments on the matrix units, float32 sums; the backward
    written out in norms/dtn_half.py) against the float64 reference, forward: within 1e-2 of
    max|ref| (measured 2-3e-3; the bfloat16 output's own rounding is 2e-3). Gradients against the
    float32 model (checked against float64 above): dx, scale, bias within 1e-2 (measured
    <= 4.5e-3); the sums over every token and channel (pos_proj, the gates) within 3e-2 (measured
    <= 1.2e-2; autodiff of the same bfloat16 function: <= 1.7e-2). Against the bfloat16 model with
    float32 moments (autodiff, same bfloat16 input, output and cotangents), what the half path's
    own rounding changes (moments, and the backward's per-element cotangents rounded to bfloat16):
    dx, scale, bias within 1e-2 (measured <= 4.9e-3), the sums within 3e-2 (measured 2.2e-2,
    docs/norms.md)."""
    side, heads, c, pre = 14, 4, 64, 1
    x = _realistic_x((2, pre + side * side, c), mean_scale, seed=3)
    mk = lambda md: build("dtn", {"position_init": init, "locality_strength": 3.0,
                                  "moments_dtype": md}, dim=c, heads=heads, grid=(side, side),
                          prefix=pre)
    m = mk(None)
    params = randomize(jit_init(m, jnp.asarray(x))["params"])
    ref = np_dtn(x.astype(np.float64), np_params(params), heads, side, pre)
    xb = jnp.asarray(x, jnp.bfloat16)
    y16 = jax.jit(m.apply)({"params": params}, xb)
    assert y16.dtype == jnp.bfloat16
    assert_rel(y16.astype(jnp.float32), ref, 1e-2, "bfloat16 forward")
    ct = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), jnp.float32)
    grad = lambda mod: jax.jit(jax.grad(lambda p, xx: jnp.sum(
        mod.apply({"params": p}, xx).astype(jnp.float32) * ct), argnums=(0, 1)))
    g32, g16, g16f = grad(m)(params, jnp.asarray(x)), grad(m)(params, xb), grad(mk("float32"))(params, xb)
    assert_rel(g16[1].astype(jnp.float32), g32[1], 1e-2, "d x")
    assert_rel(g16[1].astype(jnp.float32), g16f[1].astype(jnp.float32), 1e-2, "d x, f32 moments")
    for k in g32[0]:
        local = k in ("scale", "bias")
        assert_rel(g16[0][k], g32[0][k], 1e-2 if local else 3e-2, f"d {k}")
        assert_rel(g16[0][k], g16f[0][k], 1e-2 if local else 3e-2, f"d {k}, f32 moments")


def test_dtn_recompute_is_the_same_function():
    """recompute=True (the default in bfloat16) computes the same values and gradients as
    recompute=False, and the backward keeps only the input and the parameters: no per-channel
    float32 statistics are saved between the forward and the backward."""
    side, heads, c = 4, 2, 16
    x = jnp.asarray(random_x((2, 1 + side * side, c), seed=5))
    mk = lambda r, dt=None: build("dtn", {"recompute": r, "moments_dtype": dt}, dim=c,
                                  heads=heads, grid=(side, side), prefix=1)
    params = randomize(jit_init(mk(False), x)["params"])
    f = lambda m: (lambda p, xx: jnp.sum(jnp.sin(m.apply({"params": p}, xx))))
    for dt in (None, "bfloat16"):
        (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(f(mk(r, dt)), argnums=(0, 1)))(params, x)
                              for r in (False, True))
        assert_rel(v2, v1, 1e-6, f"value {dt}")
        for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
            assert_rel(a, b, 1e-6, f"gradient {dt}")
    def saved(m) -> int:  # bytes of the residuals the backward keeps
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda p, xx: jnp.sum(m.apply({"params": p}, xx)), params, x)
        sizes = re.findall(r"^(f32|bf16)\[([\d,]*)\]", out.getvalue(), re.M)
        assert sizes, out.getvalue()
        return sum({"f32": 4, "bf16": 2}[d] * math.prod(int(n) for n in s.split(",") if n)
                   for d, s in sizes)
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    offsets = 4 * 3 * (side * side) ** 2  # the constant (dx, dy, dx^2 + dy^2) table
    assert saved(mk(True)) <= x.size * x.dtype.itemsize + param_bytes + offsets
    assert saved(mk(False)) > 3 * x.size * x.dtype.itemsize  # what recomputing avoids


def test_dtn_bad_precision_options():
    for opts, word in (({"moments_dtype": "int8"}, "moments_dtype"), ({"recompute": 1}, "recompute")):
        with pytest.raises(ValueError, match=word):
            build("dtn", opts, dim=8, heads=2, grid=(3, 3))


def _float32_case(rng, b: int, pre: int, side: int, c: int, h: int, mix_mean: bool):
    """Tokens whose channel means are 3x their spread and DTN parameters away from their init,
    float32: what the written-out paths are checked against autodiff on."""
    x = jnp.asarray(rng.normal(size=(b, pre + side * side, c)) + 3 * rng.normal(size=c),
                    jnp.float32)
    params = {"scale": 1 + 0.3 * rng.normal(size=c), "bias": 0.3 * rng.normal(size=c),
              "pos_proj": 0.5 * rng.normal(size=(3, h)), "var_gate": rng.normal(size=h)}
    if mix_mean:
        params["mean_gate"] = rng.normal(size=h)
    return x, {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}


@pytest.mark.usefixtures("float32_matmuls")  # on a GPU: float32 products, not TF32
@pytest.mark.parametrize("pre,mix_mean", [(0, True), (1, True), (2, True), (1, False)])
def test_dtn_half_path_is_the_autodiff_function(pre, mix_mean):
    """norms/dtn_half.py (the written-out forward and backward of the half-precision path) is
    ``_dtn`` and its autodiff gradient: run in float32 (no half rounding anywhere), values within
    1e-6 and every gradient within 1e-5 of max|ref| (measured <= 1.7e-6), on tokens whose channel
    means are 3x their spread, with 0, 1 or 2 prefix tokens and with dtn_var's mean."""
    from normvit_jax.norms import dtn as dtn_module, dtn_half
    rng = np.random.default_rng(pre)
    side, h, c, b = 4, 2, 16, 3
    x, params = _float32_case(rng, b, pre, side, c, h, mix_mean)
    cfg = dtn_module._Static(side, pre, h, side, 1e-5, True, mix_mean, jnp.dtype(jnp.float32))
    g = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    want_y, want_vjp = jax.vjp(lambda a, p: dtn_module._dtn(a, p, cfg), x, params)
    got_y, got_vjp = jax.vjp(lambda a, p: dtn_half.dtn(a, p, cfg), x, params)
    assert_rel(got_y, want_y, 1e-6, "forward")
    (want_dx, want_dp), (got_dx, got_dp) = want_vjp(g), got_vjp(g)
    assert float(jnp.max(jnp.abs(want_dx))) > 0.1
    assert_rel(got_dx, want_dx, 1e-5, "d x")
    assert sorted(got_dp) == sorted(want_dp)
    for k in want_dp:
        assert_rel(got_dp[k], want_dp[k], 1e-5, f"d {k}")


def test_dtn_half_path_keeps_the_input_and_two_shifts():
    """In bfloat16 without pooling the module takes the written-out path: its backward keeps the
    input, the parameters and the two (B, 1, C) token shifts, nothing of the activation's size in
    float32; with pooling (a 28 x 28 grid pooled to 14) it keeps the checkpointed autodiff path."""
    def saved(side: int) -> list[str]:
        x = jnp.asarray(random_x((2, 1 + side * side, 16), seed=5), jnp.bfloat16)
        m = build("dtn", {}, dim=16, heads=2, grid=(side, side), prefix=1)
        params = randomize(jit_init(m, x)["params"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda p, xx: jnp.sum(m.apply({"params": p}, xx).astype(
                jnp.float32)), params, x)
        return out.getvalue().strip().splitlines()
    lines = saved(4)
    arrays = [line.split()[0] for line in lines]
    assert sorted(arrays) == sorted(["bf16[2,17,16]", "f32[2,1,16]", "f32[2,1,16]", "f32[16]",
                                     "f32[16]", "f32[3,2]", "f32[2]", "f32[2]"]), lines
    assert any("dtn_half.py" in line for line in lines), lines
    assert not any("dtn_half.py" in line for line in saved(28))

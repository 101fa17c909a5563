"""DTN in Pallas kernels (norms/dtn_pallas.py, the option kernel='pallas'), run in Pallas's
interpreter on CPU: the same function and gradients as autodiff of norms/dtn.py's ``_dtn`` in
float32, the bfloat16 layer against the float64 reference, the float32 model and XLA's path, and
where the kernels give way to XLA's path. On a GPU (``pytest -m gpu``) the bfloat16 case runs
the Triton kernels themselves at 197 tokens (every source part and target tail of a ViT-B/16
slot; tests/test_gpu.py checks them at S/16's width); the float32 cases stay CPU-only (a GPU
serves float32 tokens with XLA's path)."""
from __future__ import annotations

import functools
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shared helpers, package or not
from test_norms_common import (assert_rel, build, jit_init, np_params,  # noqa: E402
                               random_x, randomize)
from test_norms_dtn import _float32_case, _realistic_x, np_dtn  # noqa: E402


@pytest.mark.usefixtures("float32_matmuls")
@pytest.mark.parametrize("pre,mix_mean,side,c,tiling", [
    (0, True, 5, 32, None), (2, True, 5, 32, None), (1, True, 9, 64, None),
    (2, False, 9, 64, None), (1, True, 9, 64, "16/16/4:32/64/8")])
def test_dtn_pallas_kernels_are_the_autodiff_function(pre, mix_mean, side, c, tiling):
    """norms/dtn_pallas.py's kernels (Pallas's interpreter here, Triton on a GPU) run in float32:
    the output within 1e-6 of max|ref| of ``_dtn`` (measured <= 5e-7), the two token shifts those
    norms/dtn_half.py keeps, and every gradient (the backward kernel, dx's fusion and
    dP's matmul) within 1e-5 of autodiff's (measured <= 3e-6), with 0, 1 or 2 prefix tokens,
    with and without the mean's mixing, on tokens whose channel means are 3x their spread: 25
    tokens in blocks of 32 (one part of sources, one chunk of targets, a program per head), and
    81-83 in blocks of 128 (sources as 64 + 32 rows; the forward's targets a chunk of 64 and a
    tail of 32, the backward's six chunks of 16, its programs half a head each), and cut
    another way (``pallas_tiling``: the forward's programs half a head and six chunks of 16, the
    backward's a whole head, a chunk of 64 and a tail of 32). There pos_proj's
    gradient within 1e-4 (measured 3.7e-5; autodiff 1.4e-5 and the XLA path 1.8e-5 from float64
    finite differences): dP agrees to 1.2e-6 with the XLA path's,
    and the softmax's backward, which subtracts dP's weighted mean over offsets up to 128,
    amplifies float32 rounding there whichever way dP is summed."""
    from normvit_jax.norms import dtn as dtn_module, dtn_half, dtn_pallas
    rng = np.random.default_rng(10 + pre)
    h, b = 2, 3
    x, params = _float32_case(rng, b, pre, side, c, h, mix_mean)
    cfg = dtn_module._Static(side, pre, h, side, 1e-5, True, mix_mean, jnp.dtype(jnp.float32),
                             dtn_pallas.parse_tiling(tiling) if tiling else None)
    y, (shift, sq_shift, _) = jax.jit(lambda a, p: dtn_pallas.forward(a, p, cfg))(x, params)
    g = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    # Each side's output and vjp in one jitted program: run op by op, the reference and the
    # interpreted kernels' backward took 2.5x as long (the same functions, the same tolerances).
    @functools.partial(jax.jit, static_argnums=3)
    def out_and_vjp(a, p, ct, pallas):
        out, vjp = jax.vjp(lambda a, p: (dtn_pallas.dtn if pallas else dtn_module._dtn)(a, p, cfg),
                           a, p)
        return out, vjp(ct)

    want, (want_dx, want_dp) = out_and_vjp(x, params, g, False)
    assert float(jnp.max(jnp.abs(want))) > 0.5
    assert_rel(y, want, 1e-6, "forward")
    ts = jax.jit(lambda a, p: dtn_half._token_stats(a, p, cfg, None))(x, params)
    assert_rel(shift, ts.shift, 1e-6, "shift")
    # a centring constant (any value gives the same function), E[xs^2] - E[xs]^2 in float32
    # summed in another order: 2.5e-5 apart at side 9 where the means are 3x the spread
    assert_rel(sq_shift, ts.sq_shift, 1e-4, "squares' shift")
    _, (got_dx, got_dp) = out_and_vjp(x, params, g, True)
    assert_rel(got_dx, want_dx, 1e-5, "d x")
    assert sorted(got_dp) == sorted(want_dp)
    for k in want_dp:
        tol = 1e-4 if k == "pos_proj" and side > 5 else 1e-5
        assert_rel(got_dp[k], want_dp[k], tol, f"d {k}")


def test_dtn_pallas_kernel_in_bfloat16_against_float64_and_xla():
    """kernel='pallas' on bfloat16 tokens (the model's GPU training input; 197 tokens: sources
    as 128 + 64 + 16 rows, the forward's targets 3 x 64 + 16, the backward's 13 x 16): forward
    within 1e-2 of the float64 reference (measured 2.9e-3, as kernel='xla') and within 1e-2 of
    kernel='xla' (measured 3.0e-3: the two round differently, the kernels keeping their moments
    in float32); gradients within 1e-2 (the per-element ones) and 3e-2 (the sums over tokens) of
    kernel='xla''s and of the float32 model's, the bfloat16 path's own bounds above (measured
    against float32: d x 5.5e-3, pos_proj 9.6e-3, the rest <= 1.8e-3; kernel='xla': 3.9e-3,
    4.8e-3, 1.8e-3; against kernel='xla': d x 6.5e-3, pos_proj 7.5e-3)."""
    side, heads, c, pre = 14, 4, 64, 1
    x = _realistic_x((2, pre + side * side, c), 10.0, seed=3)
    mk = lambda kernel: build("dtn", {"position_init": "local", "locality_strength": 3.0,
                                      "kernel": kernel}, dim=c, heads=heads, grid=(side, side),
                              prefix=pre)
    params = randomize(jit_init(mk("xla"), jnp.asarray(x))["params"])
    ref = np_dtn(x.astype(np.float64), np_params(params), heads, side, pre)
    xb = jnp.asarray(x, jnp.bfloat16)
    got = jax.jit(mk("pallas").apply)({"params": params}, xb)
    xla = jax.jit(mk("xla").apply)({"params": params}, xb)
    assert got.dtype == jnp.bfloat16
    assert_rel(got.astype(jnp.float32), ref, 1e-2, "pallas forward")
    assert_rel(got.astype(jnp.float32), xla.astype(jnp.float32), 1e-2, "pallas vs xla")
    ct = jnp.asarray(np.random.default_rng(4).normal(size=x.shape), jnp.float32)
    grad = lambda mod: jax.jit(jax.grad(lambda p, xx: jnp.sum(  # noqa: E731
        mod.apply({"params": p}, xx).astype(jnp.float32) * ct), argnums=(0, 1)))
    (gp, gx_p), (xp, gx_x) = grad(mk("pallas"))(params, xb), grad(mk("xla"))(params, xb)
    g32, gx_32 = grad(mk("xla"))(params, jnp.asarray(x))  # the float32 model
    for want, want_x, what in ((xp, gx_x, "xla"), (g32, gx_32, "float32")):
        assert_rel(gx_p.astype(jnp.float32), want_x.astype(jnp.float32), 1e-2, f"d x vs {what}")
        for k in want:
            assert_rel(gp[k], want[k], 1e-2 if k in ("scale", "bias") else 3e-2, f"d {k} vs {what}")


@pytest.mark.parametrize("t", [1, 16, 17, 25, 50, 64, 65, 82, 83, 197, 256, 257, 785])
def test_dtn_pallas_matmul_rows_cover_the_tokens_in_power_of_two_parts(t):
    """The kernels' matmuls run over the t tokens rounded up to 16 (not over the block padded to
    a power of two): the source parts are consecutive, cover exactly round_up(t, 16) rows (197:
    128 + 64 + 16), each a power of two >= 16 starting at a multiple of itself (an aligned
    Triton block); the target chunks and their tail cover the same rows in chunks of ``rows``
    (the tail's parts each smaller than a chunk), for every chunk size the tilings accept."""
    from normvit_jax.norms import dtn_pallas
    tp = max(dtn_pallas._next_pow2(t), 16)
    m = -(-t // 16) * 16

    def check(parts, lo, end):
        for start, size in parts:
            assert start == lo and size >= 16 and size & (size - 1) == 0 and start % size == 0
            lo += size
        assert lo == end

    check(dtn_pallas._parts(0, t), 0, m)
    assert dtn_pallas._parts(0, 197) == ((0, 128), (128, 64), (192, 16))
    for chunk in (16, 32, 64, 128, 256):
        rows, count, tail = dtn_pallas._target_steps(tp, t, chunk)
        assert rows == min(tp, chunk) and all(size < rows for _, size in tail)
        check(tail, count * rows, m if tail else count * rows)
        assert count * rows >= t if not tail else count * rows < t
        assert (count * rows if not tail else m) - t < max(rows, 16)


def test_dtn_pallas_kernel_falls_back_to_xla_where_it_does_not_apply():
    """kernel='pallas' serves the half-precision path without pooling for head widths that are
    powers of two >= 16 on a GPU (and a CPU, interpreted); float32 tokens (evaluation, predict,
    export), a pooled grid, a head width of 8 and a TPU run XLA's path instead: no pallas_call
    in the program and (on the CPU) the same values as kernel='xla', bit for bit. An unknown
    kernel name or a malformed pallas_tiling is a ValueError naming the option."""
    with pytest.raises(ValueError, match="kernel"):
        build("dtn", {"kernel": "cuda"}, dim=32, heads=2, grid=(4, 4))
    for tiling in ("32/64/8", "32/64/8:16/24/8", "8/64/8:16/32/8"):
        with pytest.raises(ValueError, match="pallas_tiling"):
            build("dtn", {"kernel": "pallas", "pallas_tiling": tiling}, dim=32, heads=2,
                  grid=(4, 4))
    cases = [((2, 17, 32), 2, 4, jnp.float32, "cpu", False),
             ((2, 1 + 28 * 28, 32), 2, 28, jnp.bfloat16, "cpu", False),
             ((2, 17, 32), 4, 4, jnp.bfloat16, "cpu", False),
             ((2, 17, 32), 2, 4, jnp.bfloat16, "tpu", False),  # Triton kernels: not for a TPU
             ((2, 17, 32), 2, 4, jnp.bfloat16, "cpu", True)]
    for shape, heads, side, dtype, backend, kernel in cases:
        mk = lambda k: build("dtn", {"kernel": k}, dim=32, heads=heads,  # noqa: E731
                             grid=(side, side), prefix=1)
        x = jnp.asarray(random_x(shape, seed=1), dtype)
        params = jit_init(mk("xla"), x.astype(jnp.float32))
        with mock.patch.object(jax, "default_backend", lambda: backend):
            jaxpr = str(jax.make_jaxpr(mk("pallas").apply)(params, x))
        assert ("pallas_call" in jaxpr) == kernel, (shape, heads, dtype, backend)
        if not kernel and backend == "cpu":  # (the TPU case: traced only, its program above)
            # each jitted (one program, not op by op: seconds at 785 tokens)
            np.testing.assert_array_equal(
                np.asarray(jax.jit(mk("pallas").apply)(params, x), np.float32),
                np.asarray(jax.jit(mk("xla").apply)(params, x), np.float32))


@pytest.mark.parametrize("layout", [{}, {"norm_placement": "post"},
                                    {"cls_token_at_block": 1, "scan": True}])
def test_dtn_pallas_kernel_in_every_model_layout(layout):
    """A bfloat16 ViT with DTN in every slot, kernel='pallas': the kernels are in the program
    (blocks unrolled or scanned, pre- or post-norm, the class token joining late), and its loss
    and parameters' gradients are within 3e-2 of max|ref| of the float32 model's and of the
    bfloat16 model with kernel='xla' (measured <= 1.3e-2 and 1.2e-2; kernel='xla' in bfloat16
    is itself up to 1.2e-2 from float32: bfloat16 through two blocks)."""
    from normvit_jax import models
    cfg = {"variant": "Ti/4", "depth": 2, "hidden_size": 32, "num_heads": 2, "mlp_dim": 32,
           **layout}
    mk = lambda kernel, dtype=jnp.bfloat16: models.create(  # noqa: E731
        {**cfg, "norm": {"name": "dtn", "kernel": kernel}}, 4, dtype=dtype)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = jax.jit(mk("xla").init)(jax.random.key(1), x)

    def loss_and_grad(model):
        loss = lambda p: jnp.sum(jnp.sin(model.apply({**variables, "params": p}, x)  # noqa: E731
                                         .astype(jnp.float32)))
        return jax.value_and_grad(loss)

    traced = jax.jit(loss_and_grad(mk("pallas"))).trace(variables["params"])  # traced once
    assert "pallas_call" in str(traced.jaxpr)
    got, got_g = traced.lower().compile()(variables["params"])
    flat = lambda t: np.concatenate([np.ravel(np.asarray(a, np.float32))  # noqa: E731
                                     for a in jax.tree.leaves(t)])
    for model, what in ((mk("xla", jnp.float32), "float32"), (mk("xla"), "kernel='xla'")):
        want, want_g = jax.jit(loss_and_grad(model))(variables["params"])
        assert abs(float(got) - float(want)) <= 3e-2 * max(1.0, abs(float(want))), what
        assert_rel(flat(got_g), flat(want_g), 3e-2, f"gradients vs {what}")

"""Stateless norms, BatchNorm, LearnableScaler and Rescale against float64 numpy references
written here (not calling the modules' code); bad options; bfloat16. Shared helpers live here too.

Tolerances are relative to the largest reference value: max|jax - ref| / max|ref|.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import norms
from normvit_jax.norms.gradient_rule import train_grads

TOL = 1e-5  # float32 against float64


# ---------------------------------------------------------------- helpers (imported by the others)
def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def assert_rel(a, b, tol: float = TOL, what: str = "") -> None:
    e = rel_err(a, b)
    assert e <= tol, f"{what}: max|got-ref|/max|ref| = {e:.2e} exceeds tolerance {tol:.0e}"


def fd_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of a float64 numpy scalar function."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = f(x)
        flat[i] = old - h
        down = f(x)
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return g


def random_x(shape, seed=0, offset=0.3):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * rng.uniform(0.5, 2.0, size=shape[-1]) + offset).astype(np.float32)


def randomize(params, seed=1):
    """Random, non-trivial values for every parameter (scales near their init)."""
    rng = np.random.default_rng(seed)
    def f(path, v):
        key = jax.tree_util.keystr(path)
        noise = rng.normal(size=np.shape(v)).astype(np.float32)
        if "scale" in key or "'g'" in key:
            return jnp.asarray(np.asarray(v) * (1 + 0.3 * noise) + (np.asarray(v) == 0) * noise)
        return jnp.asarray(0.3 * noise)
    return jax.tree_util.tree_map_with_path(f, params)


def np_params(params):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def build(name, opts=None, dim=8, heads=2, grid=None, prefix=0):
    cfg = {"name": name, **(opts or {})}
    return norms.create(cfg, dim=dim, num_heads=heads, grid=grid, num_prefix_tokens=prefix)


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(f):
    """jit with unoptimised code generation, compiled once per argument shapes: these tests run
    tiny graphs a few times, so compiling dominates their time."""
    cache = {}

    def call(*args):
        key = jax.tree.structure(args), tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))
        if key not in cache:
            cache[key] = jax.jit(f).lower(*args).compile(compiler_options=FAST_COMPILE)
        return cache[key](*args)
    return call


def jit_init(module, x, train=False):
    return fast_jit(lambda k, xx: module.init(k, xx, train=train))(jax.random.PRNGKey(0),
                                                                   jnp.asarray(x))


def check_forward_and_grads(module, ref_fn, x, train=False, seed=3):
    """Output, d loss/dx and d loss/dparams (loss = sum(w * y)) against numpy + finite differences."""
    variables = jit_init(module, x, train)
    params = randomize(variables["params"]) if "params" in variables else {}
    stats = variables.get("batch_stats", {})
    w = np.random.default_rng(seed).normal(size=x.shape)

    def apply(p, xx):
        out = module.apply({"params": p, "batch_stats": stats}, xx, train=train,
                           mutable=["batch_stats"] if train else False)
        return out[0] if train else out

    def loss(p, xx):
        y = apply(p, xx)
        return jnp.sum(jnp.asarray(w, jnp.float32) * y), y

    # One jit per check: compiling the whole graph once is far cheaper than op-by-op dispatch.
    (_, y), (gp, gx) = fast_jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(x))
    pn = np_params(params)
    assert_rel(y, ref_fn(x.astype(np.float64), pn), what="forward")
    ref_loss = lambda xx, pp: float(np.sum(w * ref_fn(xx, pp)))
    assert_rel(gx, fd_grad(lambda xx: ref_loss(xx, pn), x), what="d/dx")
    for path, g in jax.tree_util.tree_leaves_with_path(gp):
        def set_leaf(v, path=path):
            return jax.tree_util.tree_map_with_path(
                lambda p2, a: v if p2 == path else a, pn)
        leaf = np.asarray(jax.tree_util.tree_reduce(lambda a, b: a, [
            a for p2, a in jax.tree_util.tree_leaves_with_path(pn) if p2 == path]))
        ref_g = fd_grad(lambda v: ref_loss(x.astype(np.float64), set_leaf(v)), leaf)
        assert_rel(g, ref_g, what=f"d/d{jax.tree_util.keystr(path)}")
    return params


# ---------------------------------------------------------------- numpy references
def ref_layernorm(x, p, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * p["scale"] + p["bias"]


def ref_rms(x, p, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * p["scale"]


def ref_scalenorm(x, p, eps=1e-5):
    return p["g"] * x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def ref_groupnorm(x, p, groups, eps=1e-5):
    b, t, c = x.shape
    blk = x.reshape(b, t, groups, c // groups).transpose(0, 2, 1, 3).reshape(b, groups, -1)
    y = (blk - blk.mean(-1, keepdims=True)) / np.sqrt(blk.var(-1, keepdims=True) + eps)
    y = y.reshape(b, groups, t, c // groups).transpose(0, 2, 1, 3).reshape(b, t, c)
    return y * p["scale"] + p["bias"]


def ref_instancenorm(x, p, unbiased=False, eps=1e-5):
    var = np.var(x, axis=1, ddof=1 if unbiased else 0, keepdims=True)  # over tokens
    return (x - x.mean(1, keepdims=True)) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def ref_batchnorm_train(x, p, eps=1e-5):
    flat = x.reshape(-1, x.shape[-1])
    return (x - flat.mean(0)) / np.sqrt(flat.var(0) + eps) * p["scale"] + p["bias"]


def ref_scaler(x, p):
    return x * p["scale"] + p["bias"]


SHAPES = [(2, 5, 8), (3, 4, 12)]
CASES = {
    "layernorm": ({}, ref_layernorm),
    "layernorm_saved_input": ({"saved_input": True}, ref_layernorm),  # the written-out backward
    "rmsnorm": ({}, ref_rms),
    "scalenorm": ({}, ref_scalenorm),
    "scalenorm_per_channel": ({"per_channel": True}, ref_scalenorm),
    "groupnorm": ({}, lambda x, p: ref_groupnorm(x, p, 2)),
    "groupnorm_4": ({"groups": 4}, lambda x, p: ref_groupnorm(x, p, 4)),
    "instancenorm": ({}, ref_instancenorm),
    "instancenorm_unbiased": ({"unbiased": True}, lambda x, p: ref_instancenorm(x, p, True)),
    "learnable_scaler": ({}, ref_scaler),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_stateless_forward_and_grads(case, shape):
    opts, ref = CASES[case]
    module = build(case.split("_")[0] if case.startswith(("scalenorm", "groupnorm", "instancenorm",
                                                          "layernorm_"))
                   else case, opts, dim=shape[-1], heads=2)
    check_forward_and_grads(module, ref, random_x(shape, seed=sum(shape)))


def test_scalenorm_init_and_clamp():
    v = build("scalenorm", dim=9).init(jax.random.PRNGKey(0), jnp.ones((1, 2, 9)))
    assert v["params"]["g"].shape == () and float(v["params"]["g"]) == pytest.approx(3.0)
    v = build("scalenorm", {"per_channel": True}, dim=9).init(jax.random.PRNGKey(0), jnp.ones((1, 2, 9)))
    np.testing.assert_allclose(v["params"]["g"], np.full(9, 3.0))
    # eps is a clamp: a tiny token is scaled by g / eps, not by g / (norm + eps).
    x = jnp.full((1, 1, 4), 1e-7)
    y = build("scalenorm", dim=4).apply({"params": {"g": jnp.asarray(2.0)}}, x)
    np.testing.assert_allclose(y, 2.0 * 1e-7 / 1e-5, rtol=1e-5)


def test_learnable_scaler_inits():
    x = jnp.ones((2, 3, 64))
    ref = build("learnable_scaler", dim=64).init(jax.random.PRNGKey(0), x)["params"]["scale"]
    assert 0.5 < float(jnp.std(ref)) < 1.5 and abs(float(jnp.mean(ref))) < 0.5  # N(0, 1)
    ones = build("learnable_scaler", {"scale_init": "ones"}, dim=64).init(jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(ones["params"]["scale"], np.ones(64))


# ---------------------------------------------------------------- BatchNorm
@pytest.mark.parametrize("shape", SHAPES)
def test_batchnorm_train_forward_and_grads(shape):
    check_forward_and_grads(build("batchnorm", dim=shape[-1]), ref_batchnorm_train,
                            random_x(shape, seed=7), train=True)


@pytest.mark.parametrize("unbiased", [False, True])
def test_batchnorm_state_and_eval(unbiased):
    module = build("batchnorm", {"unbiased_running_var": unbiased}, dim=6)
    xs = [random_x((3, 5, 6), seed=s) for s in range(3)]
    v = jit_init(module, xs[0], True)
    np.testing.assert_array_equal(v["batch_stats"]["mean"], np.zeros(6))  # init does not update
    stats, mean, var = v["batch_stats"], np.zeros(6), np.ones(6)
    for x in xs:
        _, upd = module.apply({**v, "batch_stats": stats}, jnp.asarray(x), train=True,
                              mutable=["batch_stats"])
        stats = upd["batch_stats"]
        flat = x.reshape(-1, 6).astype(np.float64)
        mean = 0.9 * mean + 0.1 * flat.mean(0)
        var = 0.9 * var + 0.1 * flat.var(0, ddof=1 if unbiased else 0)
    assert_rel(stats["mean"], mean, what="running mean")
    assert_rel(stats["var"], var, what="running var")
    p = np_params(v["params"])
    y, upd = module.apply({**v, "batch_stats": stats}, jnp.asarray(xs[0]), train=False,
                          mutable=["batch_stats"])
    assert_rel(y, (xs[0] - mean) / np.sqrt(var + 1e-5) * p["scale"] + p["bias"], what="eval")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), upd["batch_stats"], stats))


def test_batchnorm_stats_group_size():
    x = random_x((4, 3, 5), seed=11)
    module = build("batchnorm", {"stats_group_size": 2}, dim=5)
    v = jit_init(module, x, True)
    y, upd = module.apply(v, jnp.asarray(x), train=True, mutable=["batch_stats"])
    p = np_params(v["params"])
    ref = np.concatenate([ref_batchnorm_train(x[i:i + 2].astype(np.float64), p) for i in (0, 2)])
    assert_rel(y, ref, what="ghost-batch forward")
    group_means = np.stack([x[i:i + 2].reshape(-1, 5).mean(0) for i in (0, 2)]).mean(0)
    assert_rel(upd["batch_stats"]["mean"], 0.1 * group_means, what="running mean of group means")


def test_batchnorm_one_pass_variance_with_large_channel_means():
    """Both moments come from one pass, shifted by the running mean: with channel means 1000x the
    standard deviation (E[x^2] - E[x]^2 would lose every digit in float32 unshifted), a running
    mean within a few standard deviations of the batch mean gives the float64 result."""
    rng = np.random.default_rng(3)
    offset = rng.uniform(500.0, 1500.0, size=6)
    x = (rng.normal(size=(4, 7, 6)) + offset).astype(np.float32)
    module = build("batchnorm", dim=6)
    v = jit_init(module, x, True)
    stats = {"mean": jnp.asarray(offset + rng.normal(scale=3.0, size=6), jnp.float32),
             "var": v["batch_stats"]["var"]}
    y, upd = module.apply({**v, "batch_stats": stats}, jnp.asarray(x), train=True,
                          mutable=["batch_stats"])
    ref = ref_batchnorm_train(x.astype(np.float64), np_params(v["params"]))
    assert_rel(y, ref, tol=1e-4, what="forward with channel means ~1000 std")
    var64 = x.reshape(-1, 6).astype(np.float64).var(0)
    assert_rel(upd["batch_stats"]["var"], 0.9 + 0.1 * var64, tol=1e-5, what="running var")


# ---------------------------------------------------------------- Rescale
def test_rescale_forward_grads_and_state():
    module = build("rescale", dim=4)
    xs = [random_x((2, 3, 4), seed=20 + s, offset=1.0 + s) for s in range(10)]
    v = jit_init(module, xs[0], True)
    params = {"bias": jnp.asarray([0.5, -1.0, 2.0, 0.1], jnp.float32)}
    stats = v["batch_stats"]
    step = fast_jit(lambda p, s, x: train_grads(
        lambda vv: module.apply(vv, x, train=True, mutable=["batch_stats"]), p, s,
        lambda y: jnp.sum(y * jnp.arange(4.0))))
    mu0, b = np.zeros(4), np.asarray(params["bias"], np.float64)
    for i, x in enumerate(xs):
        _, grads, stats, y = step(params, stats, jnp.asarray(x))
        if i < 8:
            mu0 = mu0 + (x.reshape(-1, 4).mean(0) - mu0) / (i + 1)
            ref, gb = x + 1e-2 * b - mu0, 1e-2 * 6 * np.arange(4.0)
        else:
            ref, gb = x + b - mu0, 6 * np.arange(4.0)
        assert_rel(y, ref, what=f"step {i} forward")
        assert_rel(grads["bias"], gb, what=f"step {i} d/dbias")
    assert int(stats["count"]) == 8
    assert_rel(stats["mu0"], np.mean([x.reshape(-1, 4).mean(0) for x in xs[:8]], 0), what="mu0")
    y_eval, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[0]),
                               train=False, mutable=["batch_stats"])
    assert_rel(y_eval, xs[0] + b - mu0, what="eval")
    assert int(upd["batch_stats"]["count"]) == 8


# ---------------------------------------------------------------- errors
def test_unknown_norm_name():
    with pytest.raises(ValueError, match=r"'nope'.*known: .*batchnorm"):
        norms.create({"name": "nope"}, dim=8)


def test_unknown_option():
    with pytest.raises(ValueError, match=r"\['groupz'\].*accepted"):
        norms.create({"name": "groupnorm", "groupz": 2}, dim=8)


@pytest.mark.parametrize("name", ["groupnorm", "powernorm"])
def test_groups_not_dividing(name):
    with pytest.raises(ValueError, match=r"groups=3.*width 8.*accepted"):
        norms.create({"name": name, "groups": 3}, dim=8, num_heads=2)


def test_groups_default_heads_not_dividing():
    with pytest.raises(ValueError, match=r"'heads'.*accepted"):
        norms.create({"name": "groupnorm"}, dim=8, num_heads=3)


@pytest.mark.parametrize("grid", [None, (2, 4)])
def test_dtn_bad_grid(grid):
    with pytest.raises(ValueError, match=r"grid=.*accepted: a square patch grid"):
        norms.create({"name": "dtn"}, dim=8, num_heads=2, grid=grid)


def test_dtn_bad_token_count():
    m = norms.create({"name": "dtn"}, dim=8, num_heads=2, grid=(3, 3), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"got 9 tokens.*needs 10"):
        m.init(jax.random.PRNGKey(0), jnp.ones((1, 9, 8)))


@pytest.mark.parametrize("cfg", [{"name": "unified", "window": 0},
                                 {"name": "powernorm", "backward": "x"},
                                 {"name": "learnable_scaler", "scale_init": "zeros"},
                                 {"name": "batchnorm", "stats_group_size": -1},
                                 {"name": "dtn", "position_init": "convit"}])
def test_bad_option_values(cfg):
    key, value = [(k, v) for k, v in cfg.items() if k != "name"][0]
    with pytest.raises(ValueError, match=rf"{key}={value!r}.*accepted".replace("(", r"\(")):
        norms.create(cfg, dim=8, num_heads=2, grid=(3, 3))


def test_messages_name_the_registry_key():
    """A class under two keys (dtn_var subclasses dtn) is named by the key the config chose."""
    with pytest.raises(ValueError, match=r"norm 'dtn_var': position_init="):
        norms.create({"name": "dtn_var", "position_init": "convit"}, dim=8, num_heads=2, grid=(3, 3))
    with pytest.raises(ValueError, match=r"for norm 'instancenorm'; accepted"):
        norms.create({"name": "instancenorm", "groupz": 2}, dim=8)


def test_options_of_other_norms_are_ignored_unknown_ones_are_not():
    """A config switched to layernorm keeps powernorm's options: they are dropped, not fatal; an
    option no norm knows still fails, named alone."""
    m = norms.create({"name": "layernorm", "warmup": 5, "epsilon": 1e-3}, dim=4)
    assert m.epsilon == 1e-3
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['nobody'\] for norm 'layernorm'"):
        norms.create({"name": "layernorm", "warmup": 5, "nobody": 1}, dim=4)


def test_a_norm_that_does_not_import_breaks_only_itself(monkeypatch):
    from normvit_jax.norms import registry
    monkeypatch.setitem(registry._ENTRIES, "broken", "normvit_jax.norms.no_such_module:Broken")
    assert norms.create({"name": "layernorm", "warmup": 5}, dim=4).epsilon == 1e-6
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['nobody'\] for norm 'layernorm'"):
        norms.create({"name": "layernorm", "nobody": 1}, dim=4)
    with pytest.raises(ImportError, match="no_such_module"):
        norms.create({"name": "broken"}, dim=4)


def test_ghost_group_must_divide_batch():
    m = norms.create({"name": "batchnorm", "stats_group_size": 3}, dim=4)
    with pytest.raises(ValueError, match=r"stats_group_size=3.*batch size 4"):
        m.init(jax.random.PRNGKey(0), jnp.ones((4, 2, 4)), train=True)


# ---------------------------------------------------------------- bfloat16
BF16_CASES = [("layernorm", {}, False), ("rmsnorm", {}, False), ("scalenorm", {}, False),
              ("groupnorm", {}, False), ("instancenorm", {}, False), ("dtn", {}, False),
              ("dtn_var", {}, False), ("learnable_scaler", {"scale_init": "ones"}, False)] + [
    (n, {}, train) for n in ("batchnorm", "powernorm", "unified", "rescale", "repbn")
    for train in (0, 1)]


@pytest.mark.parametrize("offset", [40.0, 100.0])
@pytest.mark.parametrize("name,opts,train", BF16_CASES)
def test_bfloat16(name, opts, train, offset):
    """Mixed precision (float32 parameters and state, bfloat16 activations) on tokens far from 0
    (a common offset 20-200x the channels' spread, as deep in a ViT's residual stream): statistics
    taken in bfloat16 would lose the variance. Against the same layer in float32 on the same
    rounded input and cotangent: output, dx and parameter gradients within 1e-2 of max|ref|
    (bfloat16 output rounding is 2^-9 = 2e-3; measured <= 3.4e-3; DTN's parameters: its own
    test); running statistics float32 and within 1e-5 (a bfloat16 running average with momentum
    0.9 would stall on its 8-bit mantissa)."""
    x = (random_x((2, 10, 8), seed=5) + offset).astype(jnp.bfloat16)
    ct = jnp.asarray(random_x((2, 10, 8), seed=6), jnp.bfloat16).astype(jnp.float32)
    m = build(name, opts, dim=8, heads=2, grid=(3, 3), prefix=1)

    def both(key, xx):  # one compilation: init, the bfloat16 and the float32 layer with vjps
        v = m.init(key, xx.astype(jnp.float32))
        params = randomize_traced(v.get("params", {}))

        def run(a):
            f = lambda p, a: m.apply({**v, "params": p}, a, train=train, mutable=["batch_stats"])
            y, pull, new = jax.vjp(f, params, a, has_aux=True)
            return y, pull(ct.astype(y.dtype)), new.get("batch_stats", {})
        return run(xx), run(xx.astype(jnp.float32))
    (y16, g16, s16), (y32, g32, s32) = fast_jit(both)(jax.random.PRNGKey(0), x)
    assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32 and g16[1].dtype == jnp.bfloat16
    assert_rel(y16.astype(jnp.float32), y32, tol=1e-2, what=f"{name} bf16 vs f32")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g16), jax.tree.leaves(g32)):
        if name.startswith("dtn") and path[0].idx == 0:
            continue  # its gates' gradients cancel at this size: test_norms_dtn, 196 tokens
        assert_rel(np.asarray(a, np.float32), b, 1e-2, f"{name} d{jax.tree_util.keystr(path)}")
    for a, b in zip(jax.tree.leaves(s16), jax.tree.leaves(s32)):
        assert a.dtype == jnp.float32
        assert_rel(a, b, 1e-5, f"{name} running statistics")


def randomize_traced(params):
    """``randomize`` inside a jit: each parameter times 1 + 0.3 * a fixed pattern, plus 0.1."""
    def f(a):
        pattern = jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) * 2.3)
        return a * (1.0 + 0.3 * pattern) + 0.1
    return jax.tree.map(f, params)


def test_layernorm_half_precision_keeps_only_its_input():
    """In bfloat16 LayerNorm's written-out backward (the default there) keeps the bfloat16 input
    and two float32 numbers per token for the backward, not float32 copies of the activation;
    its gradients equal autodiff of the formula's (saved_input=False) within bfloat16 rounding."""
    from jax.ad_checkpoint import print_saved_residuals
    import contextlib, io, re
    x = jnp.asarray(random_x((2, 6, 16), seed=8), jnp.bfloat16)
    auto, plain = (build("layernorm", {"saved_input": s}, dim=16) for s in (None, False))
    params = randomize(jit_init(auto, x)["params"])
    ct = jnp.asarray(np.random.default_rng(9).normal(size=x.shape), jnp.float32)
    loss = lambda m: (lambda p, xx: jnp.sum(m.apply({"params": p}, xx).astype(jnp.float32) * ct))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss(auto), params, x)
    big = [ln for ln in out.getvalue().splitlines()
           if re.match(r"f32\[2,6,16\]", ln) and "constant" not in ln]  # ct is one
    assert not big and "bf16[2,6,16]" in out.getvalue(), out.getvalue()
    ga, gp = (jax.jit(jax.grad(loss(m), argnums=(0, 1)))(params, x) for m in (auto, plain))
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gp)):
        assert_rel(np.asarray(a, np.float32), np.asarray(b, np.float32), 1e-2, "gradient")


# ---------------------------------------------------------------- epsilon on small statistics
# With unit-variance inputs an epsilon of 1e-6..1e-5 changes the output by ~1e-6, below TOL: a
# norm that dropped it or added it outside the square root passed every test above. Here the
# statistic it is added to is about epsilon itself (tokens ~ sqrt(eps)), where the reference's
# placement decides the output (a factor up to sqrt(2) and more).
SMALL_CASES = {  # name: (options, reference(x, params), epsilon)
    "layernorm": ({}, ref_layernorm, 1e-6),
    "layernorm_saved_input": ({"saved_input": True}, ref_layernorm, 1e-6),
    "rmsnorm": ({}, ref_rms, 1e-6),
    "groupnorm": ({}, lambda x, p: ref_groupnorm(x, p, 2), 1e-5),
    "instancenorm": ({}, ref_instancenorm, 1e-5),
    "batchnorm_train": ({}, ref_batchnorm_train, 1e-5),
}


@pytest.mark.parametrize("case", sorted(SMALL_CASES))
def test_epsilon_inside_the_sqrt_where_it_matters(case):
    opts, ref, eps = SMALL_CASES[case]
    name = case.rsplit("_", 1)[0] if case.endswith(("_input", "_train")) else case
    name = "layernorm" if name == "layernorm_saved" else name
    x = random_x((2, 5, 8), seed=31) * np.float32(np.sqrt(eps))  # variances ~ eps
    check_forward_and_grads(build(name, opts, dim=8, heads=2), ref, x,
                            train=case.endswith("_train"))


def test_written_out_standardise_with_ddof_one_in_float32():
    """layernorm.standardise's backward with ddof=1 (the z-score's, used in half precision only by
    the model) against finite differences of the unbiased formula, in float32 where 1/C vs
    1/(C - 1) is far above the tolerance."""
    from normvit_jax.norms.layernorm import standardise
    x = random_x((2, 3, 6), seed=12)
    rng = np.random.default_rng(13)
    scale, bias = rng.normal(1.0, 0.3, 6), rng.normal(0.0, 0.3, 6)
    w = rng.normal(size=x.shape)

    def ref(xx):
        z = (xx - xx.mean(-1, keepdims=True)) / np.sqrt(xx.var(-1, ddof=1, keepdims=True) + 1e-6)
        return float(np.sum(w * (z * scale + bias)))

    gx = jax.grad(lambda xx: jnp.sum(jnp.asarray(w, jnp.float32) * standardise(
        xx, jnp.asarray(scale, jnp.float32), jnp.asarray(bias, jnp.float32), 1e-6, 1)))(
        jnp.asarray(x))
    assert_rel(gx, fd_grad(ref, x), what="d/dx, ddof=1")


@pytest.mark.parametrize("name", ["batchnorm", "unified"])
def test_eval_and_fold_epsilon_with_small_running_variances(name):
    """Eval output and the folded affine (inference_affine) use sqrt(running_var + eps), with
    running variances near eps (a channel that barely varies), against the formula."""
    c = 6
    module = build(name, dim=c)
    x = random_x((2, 4, c), seed=14)
    v = jit_init(module, x, True)
    params = randomize(v["params"])
    rng = np.random.default_rng(15)
    var = rng.uniform(0.2, 3.0, c) * 1e-5
    if name == "batchnorm":
        stats = {"mean": jnp.asarray(rng.normal(size=c), jnp.float32),
                 "var": jnp.asarray(var, jnp.float32)}
    else:
        stats = {**v["batch_stats"], "running_var": jnp.asarray(var, jnp.float32)}
    p = np_params(params)
    mean = np.asarray(stats["mean"], np.float64) if name == "batchnorm" else 0.0
    want = (x - mean) / np.sqrt(var + 1e-5) * p["scale"] + p["bias"]
    y = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(x), train=False)
    assert_rel(y, want, what="eval")
    a, c0 = module.inference_affine(params, stats)
    assert_rel(np.asarray(a) * x + np.asarray(c0), want, what="inference_affine")


def test_rescale_eval_during_its_warm_up_neither_updates_nor_scales_the_bias():
    """Eval between the first ``threshold`` training calls: x + b - mu0 with the stored mu0 and
    the full bias, and no state change (the reference would update mu0 here: docs/norms.md)."""
    module = build("rescale", dim=4)
    xs = [random_x((2, 3, 4), seed=40 + s, offset=1.0 + s) for s in range(3)]
    v = jit_init(module, xs[0], True)
    params = {"bias": jnp.asarray([0.5, -1.0, 2.0, 0.1], jnp.float32)}
    stats = v["batch_stats"]
    for x in xs[:2]:
        _, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(x), train=True,
                              mutable=["batch_stats"])
        stats = upd["batch_stats"]
    assert int(stats["count"]) == 2
    mu0 = np.mean([x.reshape(-1, 4).mean(0) for x in xs[:2]], 0)
    y, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[2]),
                          train=False, mutable=["batch_stats"])
    assert_rel(y, xs[2] + np.asarray(params["bias"]) - mu0, what="eval during warm-up")
    assert int(upd["batch_stats"]["count"]) == 2
    np.testing.assert_array_equal(upd["batch_stats"]["mu0"], stats["mu0"])

"""RepBN, progressive, zscore, minmax, DyT, Derf against float64 numpy formulas (issue 26).

Forward outputs and gradients (input and every parameter) are compared with the published formula
in numpy float64; gradients against central finite differences of that formula. Random inputs.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from normvit_jax import norms
from normvit_jax.norms.progressive import n1_weight

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")

SHAPE = (3, 5, 8)  # (B, T, C)
X = np.random.default_rng(0).normal(1.0, 2.0, size=SHAPE)
W = np.random.default_rng(1).normal(size=SHAPE)  # loss = sum(W * y): every output weighs


# ------------------------------------------------------------------ numpy float64 references

def np_bn(x, eps=1e-5):
    mean = x.mean(axis=(0, 1))
    var = x.var(axis=(0, 1))
    return (x - mean) / np.sqrt(var + eps), mean, var


def np_ref(name, x, p):
    """Train-mode output of norm ``name`` with params ``p`` (a flat dict of float64 arrays)."""
    if name == "dyt":
        return p["scale"] * np.tanh(p["alpha"] * x) + p["bias"]
    if name == "derf":
        return p["scale"] * special.erf(p["alpha"] * x + p["shift"]) + p["bias"]
    if name == "zscore":
        sd = np.sqrt(x.var(axis=-1, ddof=1, keepdims=True) + 1e-6)
        return p["scale"] * (x - x.mean(-1, keepdims=True)) / sd + p["bias"]
    if name == "minmax":
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        return p["scale"] * (x - lo) / (hi - lo + 1e-6) + p["bias"]
    if name == "repbn":
        return p["bn/scale"] * np_bn(x)[0] + p["bn/bias"] + p["eta"] * x
    if name == "layernorm":
        sd = np.sqrt(x.var(axis=-1, keepdims=True) + 1e-6)
        return p["scale"] * (x - x.mean(-1, keepdims=True)) / sd + p["bias"]
    raise KeyError(name)


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if hasattr(v, "items"):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.array(v, np.float64)
    return out


def unflat(d):
    out = {}
    for k, v in d.items():
        node = out
        *path, last = k.split("/")
        for q in path:
            node = node.setdefault(q, {})
        node[last] = jnp.asarray(v, jnp.float32)
    return out


def fd_grad(f, arr, h=1e-6):
    """Central differences of the scalar f at arr (float64)."""
    arr = np.array(arr, np.float64)  # 0-d arrays (scalar params) too
    g = np.zeros_like(arr)
    it = np.nditer(arr, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        a, b = arr.copy(), arr.copy()
        a[i] += h
        b[i] -= h
        g[i] = (f(a) - f(b)) / (2 * h)
    return g


def random_params(module, seed=2):
    """The module's params, every leaf drawn at random (not at init, where errors could hide)."""
    v = module.init(jax.random.key(0), jnp.asarray(X, jnp.float32))
    rng = np.random.default_rng(seed)
    p = {k: np.array(rng.uniform(0.5, 1.5, size=a.shape) * rng.choice([-1, 1], size=a.shape))
         for k, a in flat(v["params"]).items()}
    return v, p


# ------------------------------------------------------------------------------ the norms

@pytest.mark.parametrize("name", ["dyt", "derf", "zscore", "minmax", "repbn"])
def test_forward_and_gradients_match_numpy(name):
    module = norms.create(name, dim=SHAPE[-1])
    v, p = random_params(module)
    stats = v.get("batch_stats")

    def jax_loss(params, x):
        variables = {"params": params, **({"batch_stats": stats} if stats else {})}
        y, _ = module.apply(variables, x, train=True, mutable=["batch_stats"])
        return jnp.sum(jnp.asarray(W, jnp.float32) * y), y

    (_, y), (gp, gx) = jax.value_and_grad(jax_loss, argnums=(0, 1), has_aux=True)(
        unflat(p), jnp.asarray(X, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), np_ref(name, X, p), rtol=1e-5, atol=1e-5)
    loss = lambda x, q: float(np.sum(W * np_ref(name, x, q)))
    np.testing.assert_allclose(np.asarray(gx), fd_grad(lambda x: loss(x, p), X.copy()),
                               rtol=1e-3, atol=1e-4)
    gp = flat(gp)
    assert set(gp) == set(p)
    for k in p:
        want = fd_grad(lambda a: loss(X, {**p, k: a}), p[k].copy())
        np.testing.assert_allclose(gp[k], want, rtol=1e-3, atol=1e-4, err_msg=k)


def test_repbn_running_statistics_over_steps_and_eval_affine():
    """torch BatchNorm1d's update: momentum 0.1, unbiased variance stored; eval = a*x + c."""
    module = norms.create("repbn", dim=SHAPE[-1])
    v, p = random_params(module)
    variables = {"params": unflat(p), "batch_stats": v["batch_stats"]}
    rm, rv = np.zeros(SHAPE[-1]), np.ones(SHAPE[-1])
    n = SHAPE[0] * SHAPE[1]
    for s in range(3):
        x = np.random.default_rng(10 + s).normal(s, 1 + s, size=SHAPE)
        _, mut = module.apply(variables, jnp.asarray(x, jnp.float32), train=True,
                              mutable=["batch_stats"])
        variables["batch_stats"] = mut["batch_stats"]
        _, mean, var = np_bn(x)
        rm, rv = 0.9 * rm + 0.1 * mean, 0.9 * rv + 0.1 * var * n / (n - 1)
    got = flat(variables["batch_stats"])
    np.testing.assert_allclose(got["bn/mean"], rm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["bn/var"], rv, rtol=1e-5)
    y = module.apply(variables, jnp.asarray(X, jnp.float32), train=False)
    want = p["bn/scale"] * (X - rm) / np.sqrt(rv + 1e-5) + p["bn/bias"] + p["eta"] * X
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    a, c = module.inference_affine(variables["params"], variables["batch_stats"])
    np.testing.assert_allclose(np.asarray(a) * X + np.asarray(c), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- progressive

@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_n1_weight_at_chosen_steps(schedule):
    r0, warm, d = 0.8, 3, 10
    for step in (0, 2, 3, 4, 8, 13, 14, 100):
        k = step - warm
        if k < 0:
            want = 1.0
        elif schedule == "linear":
            want = r0 * max(0.0, 1 - k / d)
        else:
            want = r0 * (1 + math.cos(math.pi * min(k, d) / d)) / 2
        got = float(n1_weight(jnp.int32(step), r0=r0, warmup_steps=warm, decay_steps=d,
                              schedule=schedule))
        assert got == pytest.approx(want, abs=1e-6), (step, got, want)


def test_progressive_mixes_n1_and_n2_and_n2_rests_during_warmup():
    cfg = {"name": "progressive", "n1": {"name": "layernorm", "epsilon": 1e-6},
           "n2": "repbn", "warmup_steps": 2, "decay_steps": 4}
    module = norms.create(cfg, dim=SHAPE[-1])
    v, p = random_params(module)
    variables = {"params": unflat(p), "batch_stats": v["batch_stats"]}
    p1 = {k[3:]: a for k, a in p.items() if k.startswith("n1/")}
    p2 = {k[3:]: a for k, a in p.items() if k.startswith("n2/")}
    x = jnp.asarray(X, jnp.float32)
    # Warm-up: N1 alone, N2's running statistics untouched.
    y, mut = module.apply(variables, x, train=True, step=jnp.int32(1), mutable=["batch_stats"])
    np.testing.assert_allclose(np.asarray(y), np_ref("layernorm", X, p1), rtol=1e-5, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, mut["batch_stats"], variables["batch_stats"])
    # Step 3: lam = 1 - 1/4; N2's statistics move.
    step, lam = 3, 0.75

    def jax_loss(params, x):
        y, _ = module.apply({"params": params, "batch_stats": v["batch_stats"]}, x, train=True,
                            step=jnp.int32(step), mutable=["batch_stats"])
        return jnp.sum(jnp.asarray(W, jnp.float32) * y), y

    ref = lambda x, q1, q2: lam * np_ref("layernorm", x, q1) + (1 - lam) * np_ref("repbn", x, q2)
    (_, y), (gp, gx) = jax.value_and_grad(jax_loss, argnums=(0, 1), has_aux=True)(unflat(p), x)
    np.testing.assert_allclose(np.asarray(y), ref(X, p1, p2), rtol=1e-5, atol=1e-5)
    loss = lambda x, q1, q2: float(np.sum(W * ref(x, q1, q2)))
    np.testing.assert_allclose(np.asarray(gx), fd_grad(lambda a: loss(a, p1, p2), X.copy()),
                               rtol=1e-3, atol=1e-4)
    gp = flat(gp)
    for k in p:
        sub, key = k[:2], k[3:]
        f = ((lambda a: loss(X, {**p1, key: a}, p2)) if sub == "n1"
             else (lambda a: loss(X, p1, {**p2, key: a})))
        np.testing.assert_allclose(gp[k], fd_grad(f, p[k].copy()), rtol=1e-3, atol=1e-4, err_msg=k)
    _, mut = module.apply(variables, x, train=True, step=jnp.int32(step), mutable=["batch_stats"])
    n = SHAPE[0] * SHAPE[1]
    np.testing.assert_allclose(flat(mut["batch_stats"])["n2/bn/var"],
                               0.9 + 0.1 * X.var(axis=(0, 1)) * n / (n - 1), rtol=1e-5)
    # Eval: N2 alone (the reference), or the mixture at the given step.
    y = module.apply(variables, x, train=False)
    np.testing.assert_allclose(np.asarray(y), p2["bn/scale"] * X / np.sqrt(1 + 1e-5)
                               + p2["bn/bias"] + p2["eta"] * X, rtol=1e-5, atol=1e-5)
    mix = norms.create({**cfg, "eval_mode": "mixture"}, dim=SHAPE[-1])
    y = mix.apply(variables, x, train=False, step=jnp.int32(step))
    want = lam * np_ref("layernorm", X, p1) + (1 - lam) * (
        p2["bn/scale"] * X / np.sqrt(1 + 1e-5) + p2["bn/bias"] + p2["eta"] * X)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opts,match", [
    ({"n1": "nonorm"}, "n1='nonorm' is not a registered norm"),
    ({"n2": {"name": "bogus"}}, "n2='bogus' is not a registered norm"),
    ({"n2": "layernorm", "must_fold": True}, "n2='layernorm' does not fold"),
    ({"eval_mode": "mixture", "must_fold": True}, "must_fold=True needs eval_mode='n2'"),
    ({"decay_steps": 0}, "decay_steps=0 is not accepted"),
    ({"decay_steps": -5}, "decay_steps=-5 is not accepted"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"schedule": "step"}, "schedule='step' is not accepted"),
    ({"eval_mode": "n1"}, "eval_mode='n1' is not accepted"),
    ({"r0": 1.5}, "r0=1.5"),
    ({"lam": 0.5}, r"Unknown option\(s\) \['lam'\]"),
])
def test_progressive_bad_options_are_named(opts, match):
    with pytest.raises(ValueError, match=match):
        norms.create({"name": "progressive", **opts}, dim=8)


def test_progressive_train_forward_without_step_is_refused():
    module = norms.create("progressive", dim=SHAPE[-1])
    v = module.init(jax.random.key(0), jnp.asarray(X, jnp.float32))
    with pytest.raises(ValueError, match="needs the global train step"):
        module.apply(v, jnp.asarray(X, jnp.float32), train=True, mutable=["batch_stats"])


@pytest.mark.parametrize("name,opts,match", [
    ("dyt", {"affine": "yes"}, "affine='yes'"),
    ("derf", {"beta": 1.0}, "Unknown option"),
    ("repbn", {"stats_group_size": 0}, "stats_group_size=0"),
    ("zscore", {"eps": 1e-5}, "Unknown option"),
])
def test_bad_options_are_named(name, opts, match):
    with pytest.raises(ValueError, match=match):
        norms.create({"name": name, **opts}, dim=8)


# ------------------------------------------------------- the global train step, end to end

def test_train_step_feeds_the_global_step_and_logs_n1_weight():
    import optax
    from normvit_jax import models
    from normvit_jax.train import steps as steps_lib
    from normvit_jax.train.state import TrainState
    cfg = {"hidden_size": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32, "patch_size": 4,
           "norm": {"name": "progressive", "warmup_steps": 1, "decay_steps": 2}}
    model = models.create(cfg, 3)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 8, 3)), jnp.float32)
    v = model.init(jax.random.key(0), images, train=False)
    tx = optax.sgd(0.1)
    state = TrainState.create(v["params"], v["batch_stats"], tx,
                              jax.random.key_data(jax.random.key(1)))
    step = jax.jit(steps_lib.make_train_step(model, tx, optax.constant_schedule(0.1)))
    batch = {"image": images, "label": jnp.asarray([0, 1, 2, 0])}
    seen = []
    for _ in range(4):
        state, m = step(state, batch)
        seen.append(float(m.compute()["norm_n1_weight"]))
    assert seen == pytest.approx([1.0, 1.0, 0.5, 0.0])


def test_resume_in_the_middle_of_the_decay_is_bitwise_exact(tmp_path, caplog):
    """Stopped at step 3, between the log steps 2 and 4, and resumed: the same weights and norm
    state, and the same summaries (N1's weight too), as one run: the saved train-metrics window
    (ScheduledTrainMetrics here) is restored, not restarted."""
    from normvit_jax import checkpoints, summaries
    from normvit_jax.train import loop
    from tests.conftest import tiny_demo_config
    cfg = tiny_demo_config(total_steps=6, checkpoint_every=100, eval_every=100, log_every=2)
    cfg.model.norm = {"name": "progressive", "warmup_steps": 1, "decay_steps": 4}
    loop.train_and_evaluate(cfg, str(tmp_path / "a"))
    assert loop.train_and_evaluate(cfg, str(tmp_path / "b"), stop_at=3)["step"] == 3
    with caplog.at_level("WARNING"):
        loop.train_and_evaluate(cfg, str(tmp_path / "b"))
    assert not [r for r in caplog.records if "does not fit" in r.getMessage()]
    a, _ = checkpoints.load_variables(str(tmp_path / "a"))
    b, _ = checkpoints.load_variables(str(tmp_path / "b"))
    assert jax.tree.leaves(a["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, a, b)
    sa = summaries.read_scalars(str(tmp_path / "a"), include_timing=False)
    sb = summaries.read_scalars(str(tmp_path / "b"), include_timing=False)
    assert sorted(sa) == sorted(sb)
    assert [s for s, _, _ in sa["train/norm_n1_weight"]] == [2, 4, 6]
    for tag in sa:
        assert [(s, v) for s, v, _ in sa[tag]] == [(s, v) for s, v, _ in sb[tag]], tag


def np_batch_norm(name, x, p, groups):
    """BatchNorm (or RepBN: + eta * x) with the statistics of ``groups`` ghost groups, float64."""
    b, t, c = x.shape
    xg = x.reshape(groups, b // groups, t, c)
    mean, var = xg.mean(axis=(1, 2), keepdims=True), xg.var(axis=(1, 2), keepdims=True)
    pre = "bn/" if name == "repbn" else ""
    y = (p[pre + "scale"] * (xg - mean) / np.sqrt(var + 1e-5) + p[pre + "bias"]).reshape(x.shape)
    return y + p["eta"] * x if name == "repbn" else y


@pytest.mark.parametrize("n1,n2,group_size", [("layernorm", "repbn", None),
                                              ("zscore", "repbn", 1),
                                              ("layernorm", "batchnorm", 1),
                                              ("zscore", "batchnorm", None)])
def test_progressive_one_pass_equals_the_plain_mixture(n1, n2, group_size):
    """The hand-over computed in one pass (norms/token_channel.py: N1 a per-token standardiser,
    N2 BatchNorm/RepBN) equals lam * N1 + (1 - lam) * N2 written plainly in float64 numpy:
    output and running statistics to 1e-5, every gradient against central differences; in
    bfloat16 the output within 1e-2 of max|ref| (its own rounding: 4e-3)."""
    cfg = {"name": "progressive", "n1": {"name": n1}, "decay_steps": 4,
           "n2": {"name": n2, "stats_group_size": group_size}}
    module = norms.create(cfg, dim=SHAPE[-1])
    assert module.warmup_steps == 0  # the one-pass path (no warm-up branch)
    v, p = random_params(module)
    groups = 1 if group_size is None else SHAPE[0] // group_size
    step, lam = 1, 0.75
    sub = lambda q, s: {k[3:]: a for k, a in q.items() if k.startswith(s + "/")}

    def ref(x, q):
        return (lam * np_ref(n1, x, sub(q, "n1"))
                + (1 - lam) * np_batch_norm(n2, x, sub(q, "n2"), groups))

    def jax_loss(params, x):
        y, mut = module.apply({"params": params, "batch_stats": v["batch_stats"]}, x, train=True,
                              step=jnp.int32(step), mutable=["batch_stats", "schedule"])
        return jnp.sum(jnp.asarray(W, jnp.float32) * y.astype(jnp.float32)), (y, mut)

    x = jnp.asarray(X, jnp.float32)
    (_, (y, mut)), (gp, gx) = jax.value_and_grad(jax_loss, argnums=(0, 1), has_aux=True)(
        unflat(p), x)
    np.testing.assert_allclose(np.asarray(y), ref(X, p), rtol=1e-5, atol=1e-5)
    assert float(mut["schedule"]["n1_weight"][0]) == lam
    xg = X.reshape(groups, -1, *SHAPE[1:])
    n = xg.shape[1] * xg.shape[2]
    stats = flat(mut["batch_stats"])
    key = "n2/bn/" if n2 == "repbn" else "n2/"
    np.testing.assert_allclose(stats[key + "mean"], 0.1 * xg.mean(axis=(1, 2)).mean(0), rtol=1e-5,
                               atol=1e-6)
    want_var = xg.var(axis=(1, 2)).mean(0) * (n / (n - 1) if n2 == "repbn" else 1.0)
    np.testing.assert_allclose(stats[key + "var"], 0.9 + 0.1 * want_var, rtol=1e-5)
    loss = lambda xx, q: float(np.sum(W * ref(xx, q)))
    np.testing.assert_allclose(np.asarray(gx), fd_grad(lambda a: loss(a, p), X.copy()),
                               rtol=1e-3, atol=1e-4)
    gp = flat(gp)
    for k in p:
        np.testing.assert_allclose(gp[k], fd_grad(lambda a: loss(X, {**p, k: a}), p[k].copy()),
                                   rtol=1e-3, atol=1e-4, err_msg=k)
    (_, (y16, _)), _ = jax.value_and_grad(jax_loss, argnums=(0, 1), has_aux=True)(
        unflat(p), x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    ref16 = ref(np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64), p)
    err = np.max(np.abs(np.asarray(y16.astype(jnp.float32)) - ref16)) / np.max(np.abs(ref16))
    assert err <= 1e-2, err


@pytest.mark.parametrize("n1,n2", [("layernorm", "repbn"), ("zscore", "batchnorm")])
def test_progressive_one_pass_gradients_with_large_channel_means(n1, n2):
    """The one-pass backward (dx and every sum written from dy, x and small vectors) at realistic
    scales: channel means ~10x their spread, the running mean (the shift) still at its initial 0.
    float32 gradients equal float64 central differences of the plain mixture to 1e-3 of their
    largest value; from bfloat16 inputs within 3e-2 (the input, the output and its cotangent
    are rounded to 2^-9 each)."""
    cfg = {"name": "progressive", "n1": {"name": n1}, "decay_steps": 4, "n2": {"name": n2}}
    module = norms.create(cfg, dim=SHAPE[-1])
    v, p = random_params(module)
    rng = np.random.default_rng(7)
    xb = rng.normal(0.0, 10.0, size=SHAPE[-1]) + rng.normal(size=SHAPE)  # means ~10x the spread
    lam = 0.75
    sub = lambda q, s: {k[3:]: a for k, a in q.items() if k.startswith(s + "/")}
    ref = lambda x, q: (lam * np_ref(n1, x, sub(q, "n1"))
                        + (1 - lam) * np_batch_norm(n2, x, sub(q, "n2"), 1))
    loss = lambda xx, q: float(np.sum(W * ref(xx, q)))

    def grads(x):
        f = lambda params, x: jnp.sum(jnp.asarray(W, jnp.float32) * module.apply(
            {"params": params, "batch_stats": v["batch_stats"]}, x, train=True, step=jnp.int32(1),
            mutable=["batch_stats", "schedule"])[0].astype(jnp.float32))
        gp, gx = jax.grad(f, argnums=(0, 1))(unflat(p), x)
        return {"x": np.asarray(gx.astype(jnp.float32), np.float64), **flat(gp)}

    for dtype, tol in ((jnp.float32, 1e-3), (jnp.bfloat16, 3e-2)):
        x = jnp.asarray(xb, jnp.float32).astype(dtype)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        got = grads(x)
        want = {"x": fd_grad(lambda a: loss(a, p), x64.copy())}
        want.update({k: fd_grad(lambda a: loss(x64, {**p, k: a}), p[k].copy()) for k in p})
        for k in want:
            err = np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k]))
            assert err <= tol, (dtype, k, err)


# ------------------------------------------- what the tests above could not see (mutation audit)

@pytest.mark.parametrize("name,opts,want", [
    ("repbn", {}, {"eta": 1.0}), ("repbn", {"eta_init": 0.25}, {"eta": 0.25}),
    ("dyt", {}, {"alpha": 0.5}), ("dyt", {"alpha_init": 0.8}, {"alpha": 0.8}),
    ("derf", {}, {"alpha": 0.5, "shift": 0.0}),
    ("derf", {"alpha_init": 0.7, "shift_init": 0.3}, {"alpha": 0.7, "shift": 0.3}),
])
def test_init_options_reach_the_parameters(name, opts, want):
    """The scalar inits are options (DyT's alpha 0.5 is the paper's ViT value, not a constant);
    the tests above draw every parameter at random, so an ignored option passed them."""
    module = norms.create({"name": name, **opts}, dim=SHAPE[-1])
    got = flat(module.init(jax.random.key(0), jnp.asarray(X, jnp.float32))["params"])
    for k, value in want.items():
        key = "eta" if name == "repbn" else k
        assert float(got[key]) == pytest.approx(value), (name, opts, k)


@pytest.mark.parametrize("name,size", [("zscore", 1e-3), ("minmax", 1e-6)])
def test_feature_norms_epsilon_where_it_matters(name, size):
    """Tokens whose statistic (variance, range) is about epsilon (1e-6): the formula's epsilon
    placement decides the output there (with unit inputs it is below the tolerance)."""
    module = norms.create(name, dim=SHAPE[-1])
    _, p = random_params(module)
    x = X * size
    y = module.apply({"params": unflat(p)}, jnp.asarray(x, jnp.float32), train=True)
    np.testing.assert_allclose(np.asarray(y), np_ref(name, x, p), rtol=1e-5, atol=1e-5)


def test_progressive_hand_over_starts_at_warmup_steps_with_r0():
    """At step == warmup_steps the mixture starts with N1's weight r0 (the reference's first
    forward after ``warm``) and N2's running statistics move; r0 < 1 makes it visible."""
    cfg = {"name": "progressive", "n1": {"name": "layernorm", "epsilon": 1e-6}, "n2": "repbn",
           "warmup_steps": 2, "decay_steps": 4, "r0": 0.5}
    module = norms.create(cfg, dim=SHAPE[-1])
    v, p = random_params(module)
    sub = lambda s: {k[3:]: a for k, a in p.items() if k.startswith(s + "/")}  # noqa: E731
    y, mut = module.apply({"params": unflat(p), "batch_stats": v["batch_stats"]},
                          jnp.asarray(X, jnp.float32), train=True, step=jnp.int32(2),
                          mutable=["batch_stats"])
    want = 0.5 * np_ref("layernorm", X, sub("n1")) + 0.5 * np_ref("repbn", X, sub("n2"))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(flat(mut["batch_stats"])["n2/bn/mean"],
                               0.1 * X.mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)


def test_progressive_phase_that_ends_with_the_hand_over_still_mixes():
    """A compiled phase [ws + ds - 1, ws + ds) (another slot's schedule can start a phase there)
    still has N1's weight r0/ds at its step, so it mixes: it equals the step that reads the
    step number (phase None)."""
    base = {"name": "progressive", "n1": "layernorm", "n2": "repbn", "warmup_steps": 1,
            "decay_steps": 4}
    step = 1 + 4 - 1
    outs = []
    for phase in (None, (step, step + 1)):
        module = norms.create({**base, "phase": phase}, dim=SHAPE[-1])
        v, p = random_params(module)
        outs.append(np.asarray(module.apply({"params": unflat(p), "batch_stats": v["batch_stats"]},
                                            jnp.asarray(X, jnp.float32), train=True,
                                            step=jnp.int32(step), mutable=["batch_stats"])[0]))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n1,n2", [("layernorm", "repbn"), ("zscore", "batchnorm")])
def test_progressive_one_pass_with_a_running_mean_away_from_zero(n1, n2):
    """The one pass shifts by N2's running mean; every test above ran it at the running mean's
    initial 0, where a term that forgets the shift vanishes. Here the running mean is near the
    channel means (as after some steps) and the inputs have means ~10x their spread: output,
    the running mean and every gradient against the plain mixture in float64."""
    cfg = {"name": "progressive", "n1": {"name": n1}, "decay_steps": 4, "n2": {"name": n2}}
    module = norms.create(cfg, dim=SHAPE[-1])
    v, p = random_params(module)
    rng = np.random.default_rng(21)
    means = rng.normal(0.0, 10.0, size=SHAPE[-1])
    x64 = np.asarray(np.float32(means + rng.normal(size=SHAPE)), np.float64)
    running = means + rng.normal(0.0, 1.0, size=SHAPE[-1])
    key = "n2/bn/" if n2 == "repbn" else "n2/"
    stats = flat(v["batch_stats"])
    stats[key + "mean"] = running
    stats = unflat(stats)
    lam = 0.75
    sub = lambda q, s: {k[3:]: a for k, a in q.items() if k.startswith(s + "/")}  # noqa: E731
    ref = lambda x, q: (lam * np_ref(n1, x, sub(q, "n1"))  # noqa: E731
                        + (1 - lam) * np_batch_norm(n2, x, sub(q, "n2"), 1))

    def f(params, x):
        y, mut = module.apply({"params": params, "batch_stats": stats}, x, train=True,
                              step=jnp.int32(1), mutable=["batch_stats", "schedule"])
        return jnp.sum(jnp.asarray(W, jnp.float32) * y), (y, mut)

    (_, (y, mut)), (gp, gx) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        unflat(p), jnp.asarray(x64, jnp.float32))
    want = ref(x64, p)
    assert np.max(np.abs(np.asarray(y) - want)) <= 1e-5 * np.max(np.abs(want))
    np.testing.assert_allclose(flat(mut["batch_stats"])[key + "mean"],
                               0.9 * running + 0.1 * x64.mean(axis=(0, 1)), rtol=1e-5)
    loss = lambda xx, q: float(np.sum(W * ref(xx, q)))  # noqa: E731
    got = {"x": np.asarray(gx, np.float64), **flat(gp)}
    wants = {"x": fd_grad(lambda a: loss(a, p), x64.copy())}
    wants.update({k: fd_grad(lambda a: loss(x64, {**p, k: a}), p[k].copy()) for k in p})
    for k in wants:
        err = np.max(np.abs(got[k] - wants[k])) / np.max(np.abs(wants[k]))
        assert err <= 1e-3, (k, err)


def test_progressive_one_pass_epsilons_on_small_tokens():
    """N1's epsilon (LayerNorm 1e-6) and N2's (BatchNorm 1e-5) each where its own: tokens of
    variance ~1e-6, where exchanging them changes the output."""
    cfg = {"name": "progressive", "n1": {"name": "layernorm"}, "decay_steps": 4,
           "n2": {"name": "batchnorm"}}
    module = norms.create(cfg, dim=SHAPE[-1])
    v, p = random_params(module)
    x = X * 1e-3
    y = module.apply({"params": unflat(p), "batch_stats": v["batch_stats"]},
                     jnp.asarray(x, jnp.float32), train=True, step=jnp.int32(1),
                     mutable=["batch_stats"])[0]
    sub = lambda s: {k[3:]: a for k, a in p.items() if k.startswith(s + "/")}  # noqa: E731
    want = 0.75 * np_ref("layernorm", x, sub("n1")) + 0.25 * np_batch_norm("batchnorm", x, sub("n2"), 1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)

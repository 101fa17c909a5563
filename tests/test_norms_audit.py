"""An independent audit of the stateful normalizers against float64 references written from the
specification of their reference implementations (the PyTorch originals' rules as docs/norms.md
states them), on inputs with realistic scales: channel means 5-15x their spread (not zero-mean),
random signs. What the older tests (test_norms_common.py, test_norms_stateful.py,
test_norms_dynamic.py) leave open:

- PowerNorm with one group-scaling group (the reference's and configs/vit_powernorm.py's default;
  the older test uses heads), ghost groups (``stats_group_size``) and the 'dtn' backward with them;
- UN with ghost groups and a (forward, backward) window pair, the outlier step included;
- BatchNorm/RepBN: ghost groups with torch's unbiased running variance (n of a group), several
  steps with the same channel means (as a network's tokens have), then eval;
- every norm config's option values against the reference values (docs/norms.md, the seeds).

Tolerances: relative to the largest reference value, max|got - ref| / max|ref|: 1e-5 for float32
against float64 (measured <= 5e-7 for PowerNorm and UN), BatchNorm's 1e-4 (see its test).
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax.norms.gradient_rule import train_grads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shared helpers, package or not
from test_norms_common import (assert_rel, build, fast_jit, jit_init, np_params, random_x,
                               randomize, ref_batchnorm_train, ref_groupnorm, ref_instancenorm,
                               ref_layernorm, ref_rms)

TOL = 1e-5


def realistic_x(shape, seed, means=None):
    """Tokens whose channel means are 5-15x their spread, signs random (seeded)."""
    rng = np.random.default_rng(seed)
    c = shape[-1]
    if means is None:
        spread = np.random.default_rng(1000).uniform(0.5, 2.0, c)
        mr = np.random.default_rng(1001)
        means = 10.0 * spread * mr.choice([-1, 1], c) * mr.uniform(0.5, 1.5, c), spread
    mean, spread = means
    return (rng.normal(size=shape) * spread + mean).astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------- float64 references

def gs(x, G, eps=1e-5):
    """PowerNorm's group scaling x / sqrt(mean_group(x^2) + 1e-5) and its exact vjp."""
    sh = x.shape; xg = x.reshape(sh[:-1] + (G, sh[-1] // G))
    s = 1.0 / np.sqrt((xg ** 2).mean(-1, keepdims=True) + eps)
    def vjp(v):
        vg = v.reshape(xg.shape)
        return (vg * s - xg * s ** 3 * (vg * xg).mean(-1, keepdims=True)).reshape(sh)
    return (xg * s).reshape(sh), vjp

class RefPowerNorm:
    """PowerNorm (sIncerass/powernorm MaskPowerNorm): forward, running_phi, the custom backward
    (ema_gz an accumulating sum), per ghost group of ``ghost`` samples as on one GPU each (state:
    mean over groups; the 'dtn' backward reads the group's own fresh running_phi)."""

    def __init__(s, c, G, warmup, ghost=None, bwd="reference", afwd=.9, abkw=.9, eps=1e-5):
        s.c, s.G, s.warmup, s.ghost, s.bwd, s.afwd, s.abkw, s.eps = c, G, warmup, ghost, bwd, afwd, abkw, eps
        s.phi = np.ones(c); s.ema = np.zeros(c); s.t = 0
    def eval(s, x, g, b):
        return g * gs(x, s.G)[0] / np.sqrt(s.phi + s.eps) + b
    def step(s, x, g, b, dy):
        s.t += 1; t = s.t
        u, vjp = gs(x, s.G)
        B = x.shape[0]; n = B if s.ghost is None else s.ghost
        groups = [slice(i, i + n) for i in range(0, B, n)]
        psi = np.zeros(x.shape); allpsi = []
        for sl in groups:
            p2 = (u[sl] ** 2).mean((0, 1)); psi[sl] = p2; allpsi.append(p2)
        psi_all = np.mean(allpsi, 0)
        den = psi if t <= s.warmup else s.phi
        z = u / np.sqrt(den + s.eps)
        y = g * z + b
        def update(phi, p):  # the cumulative average strictly before warmup, then the EMA
            return s.afwd * (phi * (t - 1) / t + p / t if t < s.warmup else phi) + (1 - s.afwd) * p
        # Each GPU's 'dtn' backward divides by its own fresh running_phi (its psi2); the state
        # kept is the mean over the groups (the references keep rank 0's).
        phi_own = update(s.phi, psi)
        s.phi = update(s.phi, psi_all)
        gh = g * dy - (1 - s.abkw) * s.ema * z
        s.ema = s.ema + (gh * z).reshape(-1, s.c).mean(0)
        bden = phi_own if (s.bwd == "dtn" and t >= s.warmup) else psi
        du = gh / np.sqrt(bden + s.eps)
        return y, vjp(du), (dy * z).reshape(-1, s.c).sum(0), dy.reshape(-1, s.c).sum(0)

class RefUnified:
    """UN1d (hikvision-research/Unified-Normalization): windows, outlier filtration, r, the custom
    backward; each ghost group as one GPU (its own s_t/gz in the windows' slots, skip, window
    means and fresh ema_gz, as the per-GPU original: benchmarks.originals' ghost rows); the state
    kept is the mean over the groups."""

    def __init__(s, c, wf, wb, warmup, filt, ratio_warmup=1000, ghost=None, eps=1e-5, m=.9):
        s.c, s.wf, s.wb, s.warmup, s.filt, s.rw, s.ghost, s.eps, s.m = c, wf, wb, warmup, filt, ratio_warmup, ghost, eps, m
        s.rv = np.ones(c); s.ema = np.zeros(c); s.bx = np.zeros((wf, c)); s.bg = np.zeros((wb, c)); s.t = 0; s.skips = 0
    def eval(s, x, g, b):
        return g * x / np.sqrt(s.rv + s.eps) + b
    def step(s, x, g, b, dy):
        s.t += 1; t = s.t; c = s.c
        B = x.shape[0]; n = B if s.ghost is None else s.ghost
        groups = [slice(i, i + n) for i in range(0, B, n)]
        sig = np.var(np.sqrt(s.bx), ddof=1)  # before this step's statistic enters the window
        slot = t % s.wf
        var, r = np.zeros(x.shape), np.zeros(x.shape)
        skips, outs, plains, bxs, vs = [], [], [], [], []
        for sl in groups:  # each ghost group as one GPU, all starting from the same state
            st = (x[sl] ** 2).mean((0, 1))
            bx = s.bx.copy(); bx[slot] = st
            skip = s.wf == 1; out = False
            with np.errstate(divide="ignore"):
                if s.filt and t >= s.warmup:
                    am = bx.mean(0); gm = np.exp(np.log(bx).mean(0))
                    if np.any(am - gm > s.wf * sig):
                        bx[slot] = s.rv; skip = out = True
                gm = np.exp(np.log(bx).mean(0))
            plain = t <= s.wf or t < s.warmup or skip
            v = st if plain else gm
            rr = np.sqrt(v + s.eps) / np.sqrt(s.rv + s.eps)
            rr = np.ones_like(rr) if (t <= max(s.rw, s.warmup) or skip) else np.clip(rr, .2, 5)
            var[sl], r[sl] = v, rr
            skips.append(skip); outs.append(out); plains.append(plain); bxs.append(bx); vs.append(v)
        z = x / np.sqrt(var + s.eps)
        y = g * z + b
        gg = dy * g * r
        gh = np.zeros(x.shape); bgs, emas = [], []
        for sl, skip in zip(groups, skips):
            gz = (gg[sl] * z[sl]).mean((0, 1))
            bg = s.bg.copy(); bg[t % s.wb] = s.ema if skip else gz
            mgz = gz if (t <= s.wb or t < s.warmup or skip) else bg.mean(0)
            ema = s.m * s.ema + (1 - s.m) * mgz
            gh[sl] = gg[sl] - (mgz if skip else ema) * z[sl]
            bgs.append(bg); emas.append(ema)
        # The state kept: the mean over the groups (the references keep rank 0's).
        s.bx, s.rv = np.mean(bxs, 0), s.m * s.rv + (1 - s.m) * np.mean(vs, 0)
        s.bg, s.ema, s.skips = np.mean(bgs, 0), np.mean(emas, 0), s.skips + np.mean(outs)
        dx = gh / np.sqrt(var + s.eps)
        return y, dx, (dy * r * z).reshape(-1, c).sum(0), dy.reshape(-1, c).sum(0), dict(
            skip=all(skips), plain=all(plains), r=r)


def run_steps(module, sim, xs, stateful_keys, seed=5):
    """Steps through ``train_grads`` (what the train step calls) against ``sim``; then eval."""
    c = xs[0].shape[-1]
    rng = np.random.default_rng(seed)
    params = {"scale": jnp.asarray(1 + 0.3 * rng.normal(size=c), jnp.float32),
              "bias": jnp.asarray(0.3 * rng.normal(size=c), jnp.float32)}
    stats = jit_init(module, xs[0], True)["batch_stats"]

    @fast_jit
    def step(p, st, x, w):
        def apply_fn(v):
            pp, xx = v["params"]
            return module.apply({"params": pp, "batch_stats": v["batch_stats"]}, xx, train=True,
                                mutable=["batch_stats"])
        _, (gp, gx), new, y = train_grads(apply_fn, (p, x), st, lambda y: jnp.sum(w * y))
        return y, gp, gx, new

    g64, b64 = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    infos = []
    for i, x in enumerate(xs):
        w = rng.normal(size=x.shape)
        y, gp, gx, stats = step(params, stats, jnp.asarray(x, jnp.float32),
                                jnp.asarray(w, jnp.float32))
        ry, rdx, rdg, rdb, *info = sim.step(x, g64, b64, w)
        infos += info
        what = f"step {i + 1}"
        assert_rel(y, ry, TOL, f"{what} forward")
        assert_rel(gx, rdx, TOL, f"{what} dx")
        assert_rel(gp["scale"], rdg, TOL, f"{what} dscale")
        assert_rel(gp["bias"], rdb, TOL, f"{what} dbias")
        for key, attr in stateful_keys.items():
            assert_rel(stats[key], getattr(sim, attr), TOL, f"{what} {key}")
        assert int(stats["t"]) == sim.t
    y, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[0], jnp.float32),
                          train=False, mutable=["batch_stats"])
    assert_rel(y, sim.eval(xs[0], g64, b64), TOL, "eval")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), upd["batch_stats"], stats))
    return stats, infos


# ---------------------------------------------------------------- PowerNorm
@pytest.mark.parametrize("opts", [
    {"groups": 1},                                             # the reference's default
    {"groups": 1, "stats_group_size": 2},                      # per-GPU statistics
    {"groups": "heads", "stats_group_size": 2, "backward": "dtn"},
])
def test_powernorm_realistic_scales_groups_and_ghost_batches(opts):
    c, heads, warmup = 12, 3, 4
    module = build("powernorm", {**opts, "warmup": warmup}, dim=c, heads=heads)
    sim = RefPowerNorm(c, 1 if opts["groups"] == 1 else heads, warmup,
                       opts.get("stats_group_size"), opts.get("backward", "reference"))
    xs = [realistic_x((4, 9, c), seed=s) for s in range(7)]  # crosses t = warmup
    run_steps(module, sim, xs, {"running_phi": "phi", "ema_gz": "ema"})


# ---------------------------------------------------------------- Unified Normalization
@pytest.mark.parametrize("opts", [
    {"window": 4, "warmup": 5, "ratio_warmup": 6, "outlier_filtration": True,
     "stats_group_size": 2},
    {"window": (3, 2), "warmup": 2, "ratio_warmup": 2, "outlier_filtration": False,
     "stats_group_size": 2},
])
def test_unified_realistic_scales_and_ghost_batches(opts):
    c = 12
    module = build("unified", opts, dim=c)
    w = opts["window"]
    wf, wb = (w, w) if isinstance(w, int) else w
    sim = RefUnified(c, wf, wb, opts["warmup"], opts["outlier_filtration"], opts["ratio_warmup"],
                     opts["stats_group_size"])
    xs = [realistic_x((4, 9, c), seed=s) for s in range(13)]
    xs[10][..., 0] *= 30  # an outlier batch in one channel
    keys = {"running_var": "rv", "ema_gz": "ema", "buffer_x2": "bx", "buffer_gz": "bg"}
    stats, infos = run_steps(module, sim, xs, keys)
    assert float(stats["skips"]) == pytest.approx(sim.skips)
    # The run went through every path: batch statistics, windowed statistics with r != 1.
    assert any(not i["plain"] and np.any(i["r"] != 1) for i in infos)
    assert any(i["plain"] for i in infos)
    if opts["outlier_filtration"]:
        assert infos[10]["skip"], "the outlier step must skip"


# ---------------------------------------------------------------- BatchNorm, RepBN
@pytest.mark.parametrize("name,opts", [
    ("batchnorm", {"unbiased_running_var": True, "stats_group_size": 2}),
    ("repbn", {"stats_group_size": 2, "eta_init": 0.1}),
    ("repbn", {}),
])
def test_batch_statistics_ghost_groups_unbiased_store_and_eval(name, opts):
    """Per ghost group: normalised with its biased variance; the running variance stores torch's
    n/(n-1) with n = the group's samples x tokens; the running statistics average the groups.
    Tolerance 1e-4: the layer takes both moments in one pass shifted by the running mean
    (docs/norms.md, batchnorm), whose float32 error at these channel means is ~1e-5..1e-4 while
    the running mean is still far from the batch mean (measured 3e-5 at step 1)."""
    c, b, t = 12, 4, 9
    module = build(name, opts, dim=c)
    xs = [realistic_x((b, t, c), seed=s) for s in range(4)]
    v = jit_init(module, xs[0], True)
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a) + 0.3 * rng.normal(size=np.shape(a)),
                                                jnp.float32), v["params"])
    bnp = params["bn"] if name == "repbn" else params
    g, beta = (np.asarray(bnp[k], np.float64) for k in ("scale", "bias"))
    eta = float(params["eta"]) if name == "repbn" else 0.0
    if name == "repbn" and not opts:
        assert float(v["params"]["eta"]) == 1.0  # the reference's init
    n_group = opts.get("stats_group_size") or b
    unbiased = opts.get("unbiased_running_var", name == "repbn")
    stats, rm, rv = v["batch_stats"], np.zeros(c), np.ones(c)
    apply = fast_jit(lambda p, s, x: module.apply({"params": p, "batch_stats": s}, x, train=True,
                                                  mutable=["batch_stats"]))
    for i, x in enumerate(xs):
        y, upd = apply(params, stats, jnp.asarray(x, jnp.float32))
        stats = upd["batch_stats"]
        ref, means, vars_ = np.empty_like(x), [], []
        for k in range(0, b, n_group):
            xg = x[k:k + n_group]
            mu, var = xg.mean((0, 1)), xg.var((0, 1))
            ref[k:k + n_group] = g * (xg - mu) / np.sqrt(var + 1e-5) + beta + eta * xg
            n = xg.shape[0] * xg.shape[1]
            means.append(mu)
            vars_.append(var * n / (n - 1) if unbiased else var)
        rm, rv = 0.9 * rm + 0.1 * np.mean(means, 0), 0.9 * rv + 0.1 * np.mean(vars_, 0)
        s = stats["bn"] if name == "repbn" else stats
        assert_rel(y, ref, 1e-4, f"step {i + 1} forward")
        assert_rel(s["mean"], rm, TOL, f"step {i + 1} running mean")
        assert_rel(s["var"], rv, 1e-4, f"step {i + 1} running var")
    y = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[0], jnp.float32))
    assert_rel(y, g * (xs[0] - rm) / np.sqrt(rv + 1e-5) + beta + eta * xs[0], TOL, "eval")


# ---------------------------------------------------------------- configs against the references
# The option values each reference publishes (docs/norms.md, after the original code and the
# seeds' READMEs). A config that drifts from them without a documented reason is a defect.
REFERENCE_VALUES = {
    "vit_powernorm": {"name": "powernorm", "groups": 1, "warmup": 10000, "alpha_fwd": 0.9,
                      "alpha_bkw": 0.9, "epsilon": 1e-5, "backward": "reference"},
    "vit_un": {"name": "unified", "window": 4, "warmup": 4000, "ratio_warmup": 1000,
               "momentum": 0.9, "epsilon": 1e-5, "outlier_filtration": True},
    "vit_bn": {"name": "batchnorm", "momentum": 0.9, "epsilon": 1e-5},
    "vit_repbn": {"name": "repbn", "momentum": 0.9, "epsilon": 1e-5, "unbiased_running_var": True,
                  "eta_init": 1.0},
    "vit_scalenorm": {"name": "scalenorm", "epsilon": 1e-5, "per_channel": False},
    "vit_gn": {"name": "groupnorm", "groups": None, "epsilon": 1e-5},
    "vit_in": {"name": "instancenorm", "unbiased": False, "epsilon": 1e-5},
    "vit_ln": {"name": "layernorm", "epsilon": 1e-6},
    "vit_rms": {"name": "rmsnorm", "epsilon": 1e-6, "use_bias": False},
    "vit_dyt": {"name": "dyt", "alpha_init": 0.5},
    "vit_derf": {"name": "derf", "alpha_init": 0.5, "shift_init": 0.0},
    "vit_learnable_scaler": {"name": "learnable_scaler", "scale_init": "reference"},
    "vit_rescale": {"name": "rescale", "threshold": 8, "warm_bias_scale": 1e-2},
    "vit_dtn": {"name": "dtn", "epsilon": 1e-5, "ln_unbiased": True, "mix_mean": True,
                "pool_size": 14},
    # the reference's hand-over length is ImageNet's (300,000 of ~375,000 steps): on CIFAR the
    # plain config takes 80% of its own run instead (docs/recipes.md; tests/test_presets.py)
    "vit_progressive:imagenet": {"name": "progressive", "r0": 1.0, "warmup_steps": 0,
                        "decay_steps": 300_000, "schedule": "linear", "eval_mode": "n2",
                        "n1": {"name": "layernorm", "epsilon": 1e-6}, "n2": {"name": "repbn"}},
}


@pytest.mark.parametrize("config", sorted(REFERENCE_VALUES))
def test_config_norm_options_are_the_references(config):
    import importlib
    module, _, variant = config.partition(":")
    c = importlib.import_module(f"configs.{module}").get_config(variant or None)
    norm = c.model.norm.to_dict()
    for key, want in REFERENCE_VALUES[config].items():
        assert norm.get(key) == want, (f"configs/{module}.py:{variant} model.norm.{key}="
                                       f"{norm.get(key)!r}, the reference's {want!r}")


def test_layer_defaults_are_the_references():
    """A norm built with no options gets the reference layer's defaults (the configs aside)."""
    pn = build("powernorm", dim=8, heads=2)
    assert (pn.groups, pn.warmup, pn.alpha_fwd, pn.alpha_bkw, pn.epsilon, pn.group_epsilon) == \
        (1, 10000, 0.9, 0.9, 1e-5, 1e-5)
    un = build("unified", dim=8)
    assert (un.window, un.warmup, un.epsilon, un.momentum, un.outlier_filtration,
            un.ratio_warmup) == ((4, 4), 4000, 1e-5, 0.9, False, 1000)
    bn = build("batchnorm", dim=8)
    assert (bn.momentum, bn.epsilon, bn.unbiased_running_var) == (0.9, 1e-5, False)
    rb = build("repbn", dim=8)
    assert (rb.momentum, rb.epsilon, rb.unbiased_running_var, rb.eta_init) == (0.9, 1e-5, True, 1.0)
    assert build("layernorm", dim=8).epsilon == 1e-6
    assert build("scalenorm", dim=8).epsilon == 1e-5
    assert build("groupnorm", dim=8, heads=2).groups == 2
    assert build("dyt", dim=8).alpha_init == 0.5
    d = build("derf", dim=8)
    assert (d.alpha_init, d.shift_init) == (0.5, 0.0)
    r = build("rescale", dim=8)
    assert (r.threshold, r.warm_bias_scale) == (8, 1e-2)
    assert build("learnable_scaler", dim=8).scale_init == "reference"


# ---------------------------------------------------------------- options reach the computation
# Every test above uses the default epsilon/momentum/threshold (or sets an option and then reads
# the layer's field): a layer that ignored a non-default value (a hard-coded 0.9 or 1e-5) passed.

EPS_CASES = {"layernorm": ref_layernorm, "rmsnorm": ref_rms, "instancenorm": ref_instancenorm,
             "groupnorm": lambda x, p, eps: ref_groupnorm(x, p, 2, eps),
             "batchnorm": ref_batchnorm_train}


@pytest.mark.parametrize("name", sorted(EPS_CASES))
def test_a_non_default_epsilon_is_used(name):
    x = random_x((2, 5, 8), seed=50)
    module = build(name, {"epsilon": 0.3}, dim=8, heads=2)
    v = jit_init(module, x, True)
    params = randomize(v["params"])
    y = module.apply({**v, "params": params}, jnp.asarray(x), train=True, mutable=["batch_stats"])[0]
    assert_rel(y, EPS_CASES[name](x.astype(np.float64), np_params(params), eps=0.3), TOL,
               f"{name} epsilon=0.3")


@pytest.mark.parametrize("name,key", [("batchnorm", "mean"), ("repbn", "mean"),
                                      ("unified", "running_var")])
def test_a_non_default_momentum_is_used(name, key):
    """One train step from the initial state: running <- m * init + (1 - m) * batch statistic."""
    c = 6
    x = realistic_x((4, 3, c), seed=51)
    module = build(name, {"momentum": 0.5}, dim=c)
    v = jit_init(module, x, True)
    _, upd = module.apply(v, jnp.asarray(x, jnp.float32), train=True, mutable=["batch_stats"])
    stats = upd["batch_stats"]["bn"] if name == "repbn" else upd["batch_stats"]
    flat = x.reshape(-1, c)
    want = 0.5 * flat.mean(0) if key == "mean" else 0.5 + 0.5 * np.mean(flat ** 2, 0)
    assert_rel(stats[key], want, TOL, f"{name} momentum=0.5 {key}")


def test_unified_non_default_epsilon_in_training():
    """UN's first step normalises by sqrt(mean(x^2) + eps) with the configured eps."""
    c = 4
    x = random_x((2, 5, c), seed=52)
    module = build("unified", {"epsilon": 0.5}, dim=c)
    v = jit_init(module, x, True)
    params = randomize(v["params"])
    y = module.apply({**v, "params": params}, jnp.asarray(x), train=True, mutable=["batch_stats"])[0]
    p = np_params(params)
    x64 = x.astype(np.float64)
    want = p["scale"] * x64 / np.sqrt(np.mean(x64.reshape(-1, c) ** 2, 0) + 0.5) + p["bias"]
    assert_rel(y, want, TOL, "unified epsilon=0.5")


def test_powernorm_group_epsilon_is_used():
    """The group scaling's own epsilon (PowerNorm's step 1), at eval from the initial state."""
    c = 6
    x = random_x((2, 5, c), seed=53)
    module = build("powernorm", {"group_epsilon": 2.0, "groups": "heads"}, dim=c, heads=2)
    v = jit_init(module, x, True)
    params = randomize(v["params"])
    y = module.apply({**v, "params": params}, jnp.asarray(x))
    p = np_params(params)
    u = gs(x.astype(np.float64), 2, eps=2.0)[0]
    assert_rel(y, p["scale"] * u / np.sqrt(1.0 + 1e-5) + p["bias"], TOL, "group_epsilon=2")


def test_rescale_threshold_is_used():
    """mu0 averages the first ``threshold`` batches (3 here, not the default 8), then freezes."""
    module = build("rescale", {"threshold": 3}, dim=4)
    xs = [random_x((2, 3, 4), seed=60 + s, offset=1.0 + s) for s in range(5)]
    v = jit_init(module, xs[0], True)
    stats = v["batch_stats"]
    for x in xs:
        _, upd = module.apply({**v, "batch_stats": stats}, jnp.asarray(x), train=True,
                              mutable=["batch_stats"])
        stats = upd["batch_stats"]
    assert int(stats["count"]) == 3
    assert_rel(stats["mu0"], np.mean([x.reshape(-1, 4).mean(0) for x in xs[:3]], 0), TOL, "mu0")

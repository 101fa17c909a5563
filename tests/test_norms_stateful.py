"""PowerNorm and Unified Normalization against float64 numpy simulations of the reference rules
(docs/norms.md, after their reference implementations): forward, the custom backward (dx, dgamma, dbeta) and every piece of state after each
of several steps, across the warmup boundaries, a skip and an outlier step (UN).

The JAX side runs the rule the train step calls (normvit_jax.norms.gradient_rule.train_grads):
grads w.r.t. params and the input batch_stats, new_batch_stats = forward-mutated + cotangent.
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
from test_norms_common import assert_rel, build, fast_jit, jit_init, randomize

TOL = 1e-5


def make_step(module):
    """One step through ``train_grads``, the function the train step calls; the input x rides
    along with the params so that its gradient (dx) comes back too."""
    @fast_jit
    def step(params, stats, x, w):
        def apply_fn(v):
            p, xx = v["params"]
            return module.apply({"params": p, "batch_stats": v["batch_stats"]}, xx, train=True,
                                mutable=["batch_stats"])
        _, (gp, gx), new_stats, y = train_grads(apply_fn, (params, x), stats,
                                                lambda y: jnp.sum(w * y))
        return y, gp, gx, new_stats
    return step


# ---------------------------------------------------------------- PowerNorm
class NpPowerNorm:
    """The reference PowerNorm step in float64 (forward, state update, custom backward)."""

    def __init__(self, c, groups, warmup, backward="reference", afwd=0.9, abkw=0.9, eps=1e-5):
        self.c, self.groups, self.warmup, self.backward = c, groups, warmup, backward
        self.afwd, self.abkw, self.eps = afwd, abkw, eps
        self.phi, self.ema, self.t = np.ones(c), np.zeros(c), 0

    def scale(self, x):
        xg = x.reshape(x.shape[:-1] + (self.groups, -1))
        s = 1 / np.sqrt(np.mean(xg * xg, -1, keepdims=True) + 1e-5)
        return xg, s, (xg * s).reshape(x.shape)

    def eval(self, x, gamma, beta):
        return gamma * self.scale(x)[2] / np.sqrt(self.phi + self.eps) + beta

    def step(self, x, gamma, beta, dy):
        self.t += 1
        t = self.t
        xg, s, u = self.scale(x)
        psi2 = np.mean(u.reshape(-1, self.c) ** 2, 0)
        z = u / np.sqrt((psi2 if t <= self.warmup else self.phi) + self.eps)
        y = gamma * z + beta
        if t < self.warmup:
            self.phi = self.phi * (t - 1) / t + psi2 / t
        self.phi = self.afwd * self.phi + (1 - self.afwd) * psi2
        g_hat = dy * gamma - (1 - self.abkw) * self.ema * z
        self.ema = self.ema + np.mean((g_hat * z).reshape(-1, self.c), 0)
        use_phi = self.backward == "dtn" and t >= self.warmup
        du = g_hat / np.sqrt((self.phi if use_phi else psi2) + self.eps)
        dug = du.reshape(xg.shape)  # through the group scaling u = x * s(x)
        dx = (dug * s - xg * s ** 3 * np.mean(dug * xg, -1, keepdims=True)).reshape(x.shape)
        flat = lambda a: a.reshape(-1, self.c)
        return y, dx, flat(dy * z).sum(0), flat(dy).sum(0)


@pytest.mark.parametrize("backward", ["reference", "dtn"])
def test_powernorm_steps_against_numpy(backward):
    c, warmup = 6, 3
    module = build("powernorm", {"groups": "heads", "warmup": warmup, "backward": backward},
                   dim=c, heads=2)
    rng = np.random.default_rng(0)
    xs = [(rng.normal(size=(2, 5, c)) * rng.uniform(0.3, 3, c) + 0.2).astype(np.float32)
          for _ in range(6)]
    v = jit_init(module, xs[0], True)
    params, stats = randomize(v["params"]), v["batch_stats"]
    assert int(stats["t"]) == 0  # init does not count as a step
    gamma, beta = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    sim, step = NpPowerNorm(c, 2, warmup, backward), make_step(module)
    for i, x in enumerate(xs):
        w = rng.normal(size=x.shape).astype(np.float32)
        y, gp, gx, stats = step(params, stats, jnp.asarray(x), jnp.asarray(w))
        ry, rdx, rdg, rdb = sim.step(x.astype(np.float64), gamma, beta, w.astype(np.float64))
        what = f"{backward} step {i + 1}"
        assert_rel(y, ry, TOL, f"{what} forward")
        assert_rel(gx, rdx, TOL, f"{what} dx")
        assert_rel(gp["scale"], rdg, TOL, f"{what} dgamma")
        assert_rel(gp["bias"], rdb, TOL, f"{what} dbeta")
        assert_rel(stats["running_phi"], sim.phi, TOL, f"{what} running_phi")
        assert_rel(stats["ema_gz"], sim.ema, TOL, f"{what} ema_gz")
        assert int(stats["t"]) == sim.t
    # Eval: running_phi, no state change.
    y, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[0]), train=False,
                          mutable=["batch_stats"])
    assert_rel(y, sim.eval(xs[0].astype(np.float64), gamma, beta), TOL, "eval")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), upd["batch_stats"], stats))


def test_powernorm_forward_ignores_ema_gz():
    module = build("powernorm", dim=4)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 4)), jnp.float32)
    v = jit_init(module, x, True)
    stats2 = {**v["batch_stats"], "ema_gz": jnp.arange(4.0)}
    y1 = module.apply(v, x, train=True, mutable=["batch_stats"])[0]
    y2 = module.apply({**v, "batch_stats": stats2}, x, train=True, mutable=["batch_stats"])[0]
    np.testing.assert_array_equal(y1, y2)


# ---------------------------------------------------------------- Unified Normalization
class NpUnified:
    """The reference UN1d step in float64."""

    def __init__(self, c, wf, wb, warmup, filtration, ratio_warmup, eps=1e-5, m=0.9):
        self.c, self.wf, self.wb, self.warmup = c, wf, wb, warmup
        self.filtration, self.ratio_warmup, self.eps, self.m = filtration, ratio_warmup, eps, m
        self.rv, self.ema = np.ones(c), np.zeros(c)
        self.bx, self.bg = np.zeros((wf, c)), np.zeros((wb, c))
        self.t = self.skips = 0

    def step(self, x, gamma, beta, dy):
        self.t += 1
        t, flat = self.t, (lambda a: a.reshape(-1, self.c))
        sq = np.mean(flat(x) ** 2, 0)
        sigma_rec = np.var(np.sqrt(self.bx), ddof=1)  # one scalar, before inserting
        self.bx[t % self.wf] = sq
        skip = self.wf == 1
        with np.errstate(divide="ignore"):
            if self.filtration and t >= self.warmup:
                am, gm = self.bx.mean(0), np.exp(np.mean(np.log(self.bx), 0))
                if np.any(am - gm > sigma_rec * self.wf):
                    self.bx[t % self.wf] = self.rv
                    skip, self.skips = True, self.skips + 1
            windowed = not (t <= self.wf or t < self.warmup or skip)
            var = np.exp(np.mean(np.log(self.bx), 0)) if windowed else sq
        r = np.sqrt(var + self.eps) / np.sqrt(self.rv + self.eps)
        r = np.ones(self.c) if t <= max(self.ratio_warmup, self.warmup) or skip else np.clip(r, .2, 5)
        z = x / np.sqrt(var + self.eps)
        y = gamma * z + beta
        self.rv = self.m * self.rv + (1 - self.m) * var
        g = dy * gamma * r
        gz = np.mean(flat(g * z), 0)
        self.bg[t % self.wb] = self.ema if skip else gz
        mean_gz = gz if (t <= self.wb or t < self.warmup or skip) else self.bg.mean(0)
        self.ema = self.m * self.ema + (1 - self.m) * mean_gz
        g_hat = g - (mean_gz if skip else self.ema) * z
        dx = g_hat / np.sqrt(var + self.eps)
        info = {"skip": skip, "windowed": windowed, "r": r}
        return y, dx, flat(dy * r * z).sum(0), flat(dy).sum(0), info


def test_unified_steps_against_numpy():
    c, wf, wb, warmup, ratio_warmup = 4, 3, 2, 4, 5
    module = build("unified", {"window": (wf, wb), "warmup": warmup, "outlier_filtration": True,
                               "ratio_warmup": ratio_warmup}, dim=c)
    rng = np.random.default_rng(0)
    scales = np.array([0.9, 1.0, 1.1, 1.05])
    xs, ws = [], []
    for i in range(12):
        x = rng.normal(size=(2, 5, c)) * scales
        if i == 8:
            x[..., 0] *= 30  # an outlier batch in one channel
        xs.append(x.astype(np.float32))
        ws.append(rng.normal(size=x.shape).astype(np.float32))
    v = jit_init(module, xs[0], True)
    params, stats = randomize(v["params"]), v["batch_stats"]
    gamma, beta = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    sim, step = NpUnified(c, wf, wb, warmup, True, ratio_warmup), make_step(module)
    seen = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        y, gp, gx, stats = step(params, stats, jnp.asarray(x), jnp.asarray(w))
        ry, rdx, rdg, rdb, info = sim.step(x.astype(np.float64), gamma, beta, w.astype(np.float64))
        seen.append(info)
        what = f"step {i + 1} ({'skip' if info['skip'] else 'windowed' if info['windowed'] else 'batch'})"
        assert_rel(y, ry, TOL, f"{what} forward")
        assert_rel(gx, rdx, TOL, f"{what} dx")
        assert_rel(gp["scale"], rdg, TOL, f"{what} dgamma")
        assert_rel(gp["bias"], rdb, TOL, f"{what} dbeta")
        for key, ref in (("running_var", sim.rv), ("ema_gz", sim.ema), ("buffer_x2", sim.bx),
                         ("buffer_gz", sim.bg)):
            assert_rel(stats[key], ref, TOL, f"{what} {key}")
        assert int(stats["t"]) == sim.t and int(stats["skips"]) == sim.skips, what
    # The scenario covers every path: batch statistics during warmup, the warmup-boundary skip
    # (zero-initialised window), windowed steps with r clipped, and the outlier step.
    assert seen[8]["skip"] and not seen[7]["skip"], "the outlier step must skip"
    assert any(s["windowed"] and np.any(s["r"] != 1) for s in seen)
    assert any(s["windowed"] and np.any(s["r"] == 0.2) for s in seen)
    assert not any(s["windowed"] or s["skip"] for s in seen[:warmup - 1])
    # Eval: running_var, no state change.
    y, upd = module.apply({"params": params, "batch_stats": stats}, jnp.asarray(xs[0]), train=False,
                          mutable=["batch_stats"])
    assert_rel(y, gamma * xs[0] / np.sqrt(sim.rv + 1e-5) + beta, TOL, "eval")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), upd["batch_stats"], stats))


def test_unified_window_one_always_skips_and_filtration_off():
    c = 3
    module = build("unified", {"window": (1, 1), "warmup": 1, "ratio_warmup": 1}, dim=c)
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(2, 4, c)).astype(np.float32) * 2 for _ in range(4)]
    v = jit_init(module, xs[0], True)
    params, stats = randomize(v["params"]), v["batch_stats"]
    gamma, beta = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    sim, step = NpUnified(c, 1, 1, 1, False, 1), make_step(module)
    for i, x in enumerate(xs):
        w = rng.normal(size=x.shape).astype(np.float32)
        y, gp, gx, stats = step(params, stats, jnp.asarray(x), jnp.asarray(w))
        ry, rdx, rdg, _, info = sim.step(x.astype(np.float64), gamma, beta, w.astype(np.float64))
        assert info["skip"]
        assert_rel(y, ry, TOL, f"step {i + 1} forward")
        assert_rel(gx, rdx, TOL, f"step {i + 1} dx")
        assert_rel(stats["ema_gz"], sim.ema, TOL, f"step {i + 1} ema_gz")
        assert_rel(stats["buffer_gz"], sim.bg, TOL, f"step {i + 1} buffer_gz")


def test_unified_ratio_stays_one_through_a_warmup_longer_than_ratio_warmup():
    """The reference's own setting, warmup 4000 > ratio_warmup 1000: r is 1 while
    t <= max(ratio_warmup, warmup), so through the whole warmup, not only ratio_warmup steps
    (the other tests all had ratio_warmup >= warmup). Batches scaled away from running_var's 1,
    so a ratio taken early would differ from 1."""
    c, wf, warmup, ratio_warmup = 4, 2, 6, 2
    module = build("unified", {"window": wf, "warmup": warmup, "ratio_warmup": ratio_warmup},
                   dim=c)
    rng = np.random.default_rng(4)
    xs = [(rng.normal(size=(2, 5, c)) * rng.uniform(2.0, 3.0, c)).astype(np.float32)
          for _ in range(8)]
    v = jit_init(module, xs[0], True)
    params, stats = randomize(v["params"]), v["batch_stats"]
    gamma, beta = (np.asarray(params[k], np.float64) for k in ("scale", "bias"))
    sim, step = NpUnified(c, wf, wf, warmup, False, ratio_warmup), make_step(module)
    seen = []
    for i, x in enumerate(xs):
        w = rng.normal(size=x.shape).astype(np.float32)
        y, gp, gx, stats = step(params, stats, jnp.asarray(x), jnp.asarray(w))
        ry, rdx, rdg, _, info = sim.step(x.astype(np.float64), gamma, beta, w.astype(np.float64))
        seen.append(info)
        assert_rel(y, ry, TOL, f"step {i + 1} forward")
        assert_rel(gx, rdx, TOL, f"step {i + 1} dx")
        assert_rel(gp["scale"], rdg, TOL, f"step {i + 1} dgamma")
        assert_rel(stats["ema_gz"], sim.ema, TOL, f"step {i + 1} ema_gz")
    assert all(np.all(s["r"] == 1) for s in seen[:warmup])
    assert any(np.any(s["r"] != 1) for s in seen[warmup:])


def test_unified_outlier_threshold_uses_the_unbiased_variance():
    """sigma_rec is the UNBIASED variance of sqrt(window) (W*C entries): a batch whose AM - GM
    lies between W times the biased and W times the unbiased variance is not an outlier. The
    window and the step are set so; the batch's mean square is exact (|x| constant)."""
    c, wf = 3, 4
    module = build("unified", {"window": wf, "warmup": 1, "outlier_filtration": True}, dim=c)
    rng = np.random.default_rng(6)
    buf = rng.uniform(1.0, 2.0, size=(wf, c))
    t = 9.0  # the step is t + 1 = 10: its slot is 10 % 4 = 2
    slot = int(t + 1) % wf
    sig_u, sig_b = np.var(np.sqrt(buf), ddof=1), np.var(np.sqrt(buf), ddof=0)
    target = wf * (sig_u + sig_b) / 2  # between the two thresholds

    def am_gm(v):  # channel 0's AM - GM once v enters the slot
        col = buf[:, 0].copy()
        col[slot] = v
        return col.mean() - np.exp(np.log(col).mean())
    lo, hi = buf[:, 0].max(), 1e4
    for _ in range(200):  # AM - GM grows with v above the window's values
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if am_gm(mid) < target else (lo, mid)
    s = np.array([lo, *[np.exp(np.log(buf[:, k]).mean()) for k in (1, 2)]])  # others: tiny AM-GM
    new = buf.copy()
    new[slot] = s
    gap = new.mean(0) - np.exp(np.log(new).mean(0))
    assert wf * sig_b < gap.max() < wf * sig_u, (gap, wf * sig_b, wf * sig_u)
    signs = rng.choice([-1.0, 1.0], size=(2, 8, c))
    x = (signs * np.sqrt(s)).astype(np.float32)
    v = jit_init(module, x, True)
    stats = {**v["batch_stats"], "buffer_x2": jnp.asarray(buf, jnp.float32),
             "t": jnp.float32(t), "running_var": jnp.asarray(buf.mean(0), jnp.float32)}
    _, upd = module.apply({**v, "batch_stats": stats}, jnp.asarray(x), train=True,
                          mutable=["batch_stats"])
    assert int(upd["batch_stats"]["skips"]) == 0, "not an outlier by the unbiased variance"
    assert_rel(upd["batch_stats"]["buffer_x2"][slot], s, TOL, "this step's statistic entered")

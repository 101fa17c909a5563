"""Mixup/CutMix and random erasing on device against numpy float64 references of timm's published
algorithms (fed the same random draws), and the train step unchanged when they are off."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from normvit_jax import data, models
from normvit_jax.train import batch_aug, erasing, mixing
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState
from tests.conftest import tiny_demo_config, with_default_xla_flags

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")


def _timm_box(c, cut, size, box):
    """timm/data/mixup.py rand_bbox along one axis: 1.0.28 and before ('even'): c +- cut // 2;
    1.0.29 and later ('exact'): [c - cut // 2, c + (cut + 1) // 2); clipped to [0, size]."""
    hi = c + (cut + 1) // 2 if box == "exact" else c + cut // 2
    return int(np.clip(c - cut // 2, 0, size)), int(np.clip(hi, 0, size))


def _spec(c, num_classes):
    """The config's DataSpec with ``num_classes`` labels (mixing only reads that)."""
    return dataclasses.replace(data.resolve_data_spec(c), num_classes=num_classes)


def _ref_mix(x, y, lam, cutmix, cy, cx, n_classes, box="even"):
    """timm Mixup._mix_elem / _mix_pair / _mix_batch written per row, float64: row i takes the
    pixels of row B-1-i (from the unmixed batch); box = rand_bbox with lam corrected by its area."""
    x = np.asarray(x, np.float64)
    b, h, w, _ = x.shape
    out, lams = x.copy(), np.array(lam, np.float64)
    for i in range(b):
        j = b - 1 - i
        if lam[i] == 1.0:
            continue
        if cutmix[i]:
            r = math.sqrt(1.0 - lam[i])
            ch, cw = int(h * r), int(w * r)
            (yl, yh), (xl, xh) = _timm_box(cy[i], ch, h, box), _timm_box(cx[i], cw, w, box)
            out[i, yl:yh, xl:xh] = x[j, yl:yh, xl:xh]
            lams[i] = 1.0 - (yh - yl) * (xh - xl) / (h * w)
        else:
            out[i] = x[i] * lam[i] + x[j] * (1.0 - lam[i])
    onehot = np.eye(n_classes)[y]
    return out, lams[:, None] * onehot + (1.0 - lams[:, None]) * onehot[::-1]


def _batch(b=8, s=16, seed=0, n=5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, s, s, 3)).astype(np.float32),
            rng.integers(0, n, b).astype(np.int32))


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("alphas", [(0.8, 1.0), (0.8, 0.0), (0.0, 1.0)])
def test_mix_matches_the_numpy_reference(mode, alphas):
    x, y = _batch()
    cfg = mixing.MixConfig(*alphas, prob=0.8, switch_prob=0.5, mode=mode)
    seen_cut = seen_mix = 0
    for seed in range(6):
        p = mixing.draw(jax.random.key(seed), 8, 16, 16, cfg)
        got_x, got_t = jax.jit(mixing.apply, static_argnums=3)(x, y, p, 5)
        p = {k: np.asarray(v) for k, v in p.items()}
        if mode == "batch":
            assert all((v == v[0]).all() for v in p.values())
        if mode == "pair":
            assert all((v == v[::-1]).all() for v in p.values())
        if alphas[1] == 0.0:
            assert not p["cutmix"].any()
        if alphas[0] == 0.0:
            assert p["cutmix"].all()
        ref_x, ref_t = _ref_mix(x, y, p["lam"].astype(np.float64), p["cutmix"], p["cy"], p["cx"], 5)
        np.testing.assert_allclose(got_x, ref_x, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_t, ref_t, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(got_t).sum(1), 1.0, rtol=1e-6)
        seen_cut += int((p["cutmix"] & (p["lam"] < 1)).any())
        seen_mix += int((~p["cutmix"] & (p["lam"] < 1)).any())
    assert seen_cut or alphas[1] == 0.0  # the draws exercised the branch under test
    assert seen_mix or alphas[0] == 0.0


@pytest.mark.parametrize("box", ["even", "exact"])
def test_cutmix_box_and_lam_correction_against_formula(box):
    """Box sides int(S*sqrt(1-lam)), centred at (cy, cx), clipped (timm's rule of each version);
    lam = 1 - area / S^2, and the target weight of the partner class equals the fraction of pasted
    pixels."""
    s = 16
    lam = np.array([0.3, 0.5, 0.9, 0.99, 0.05, 0.7], np.float32)
    cy = np.array([0, 15, 8, 3, 7, 14], np.int32)
    cx = np.array([0, 2, 8, 12, 9, 15], np.int32)
    yl, yh, xl, xh = (np.asarray(v) for v in mixing.rand_bbox(s, s, lam, cy, cx, box))
    odd = 0
    for i in range(len(lam)):
        cut = int(s * math.sqrt(1 - float(lam[i])))
        odd += cut % 2
        assert (yl[i], yh[i]) == _timm_box(cy[i], cut, s, box)
        assert (xl[i], xh[i]) == _timm_box(cx[i], cut, s, box)
    assert odd  # an odd cut, where the two rules differ
    # Images 0 and partner 1: the pasted region is where the mixed image equals the partner.
    x = np.stack([np.zeros((s, s, 1)), np.ones((s, s, 1))] * 3).astype(np.float32)
    y = np.array([0, 1] * 3, np.int32)
    p = {"lam": jnp.asarray(lam), "cutmix": jnp.ones(6, bool), "cy": jnp.asarray(cy),
         "cx": jnp.asarray(cx)}
    mixed, t = mixing.apply(x, y, p, 2, box)
    for i in range(6):
        partner_frac = float(np.mean(np.asarray(mixed[i]) != x[i]))
        np.testing.assert_allclose(t[i, 1 - y[i]], partner_frac, rtol=1e-6)
        np.testing.assert_allclose(t[i, y[i]], 1 - partner_frac, rtol=1e-6)


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_mix_groups_draw_and_pair_within_each_slice_as_timm_per_process(mode):
    """mix_groups=g: the batch is g consecutive slices, each a timm process's batch: its own draw
    (key g of split(key, g)) and partner row n-1-i inside the slice. Checked against the numpy
    reference per slice, with the 'exact' box."""
    x, y = _batch(b=12, s=16, seed=4)
    cfg = mixing.MixConfig(0.8, 1.0, prob=1.0, switch_prob=0.5, mode=mode, box="exact", groups=3)
    for seed in range(3):
        key = jax.random.key(seed)
        got_x, got_t = mixing.mix(key, x, y, cfg, 5)
        keys = jax.random.split(key, 3)
        lams = []
        for g in range(3):
            sl = slice(4 * g, 4 * g + 4)
            p = {k: np.asarray(v) for k, v in mixing.draw(keys[g], 4, 16, 16, cfg).items()}
            lams.append(float(p["lam"][0]))
            ref_x, ref_t = _ref_mix(x[sl], y[sl], p["lam"].astype(np.float64), p["cutmix"],
                                    p["cy"], p["cx"], 5, box="exact")
            np.testing.assert_allclose(got_x[sl], ref_x, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got_t[sl], ref_t, rtol=1e-6, atol=1e-7)
        assert len(set(lams)) == 3  # three independent draws, not one per batch
    with pytest.raises(ValueError, match="mix_groups=5"):
        mixing.from_config(tiny_demo_config(mixup_alpha=0.8, batch_size=12, mix_groups=5))


def test_mix_prob_zero_and_alpha_zero_leave_the_batch_alone():
    x, y = _batch()
    for cfg in (mixing.MixConfig(0.8, 1.0, prob=0.0, mode="elem"),
                mixing.MixConfig(0.8, 1.0, prob=0.0, mode="batch")):
        got_x, got_t = mixing.mix(jax.random.key(3), x, y, cfg, 5)
        np.testing.assert_array_equal(got_x, x)
        np.testing.assert_array_equal(got_t, np.eye(5, dtype=np.float32)[y])
    for overrides in ({}, {"mixup_alpha": 0.8, "mix_prob": 0.0}, {"cutmix_alpha": 0.0}):
        assert batch_aug.make(tiny_demo_config(**overrides), _spec(tiny_demo_config(), 10)) is None


def test_mix_lambda_distribution_is_beta():
    """Mixup's lam over many elem draws: Beta(a, a) mean 1/2 and variance 1/(4(2a+1))."""
    a = 0.8
    p = mixing.draw(jax.random.key(0), 20000, 8, 8, mixing.MixConfig(a, 0.0, prob=1.0, mode="elem"))
    lam = np.asarray(p["lam"], np.float64)
    np.testing.assert_allclose(lam.mean(), 0.5, atol=0.01)
    np.testing.assert_allclose(lam.var(), 1 / (4 * (2 * a + 1)), rtol=0.05)


def _tiny_step(transform):
    mdl = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                         "mlp_dim": 32, "dropout_rate": 0.1}, 5)
    tx = optax.adamw(1e-3)
    # one jitted program (op by op, each primitive compiled alone: seconds, more so in the child
    # of with_default_xla_flags, which compiles each with XLA's optimizations)
    v = jax.jit(mdl.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
    state = TrainState.create(v["params"], {}, tx, jax.random.key_data(jax.random.key(1)))
    step = jax.jit(steps_lib.make_train_step(mdl, tx, optax.constant_schedule(1e-3),
                                             label_smoothing=0.1, batch_transform=transform))
    return step, state


@with_default_xla_flags  # the unoptimized programs may differ in the last bit
def test_train_step_with_prob_zero_mixing_is_bit_identical():
    x, y = _batch()
    batch = {"image": jnp.asarray(x), "label": jnp.asarray(y)}
    off = mixing.MixConfig(0.8, 1.0, prob=0.0, mode="elem")
    step_a, s_a = _tiny_step(None)
    step_b, s_b = _tiny_step(lambda k, im, lb: mixing.mix(k, im, lb, off, 5))
    for _ in range(2):
        s_a, m_a = step_a(s_a, batch)
        s_b, m_b = step_b(s_b, batch)
    for a, b in zip(jax.tree.leaves((s_a, m_a.compute())), jax.tree.leaves((s_b, m_b.compute()))):
        np.testing.assert_array_equal(a, b)


def test_cross_entropy_soft_targets_with_smoothing_match_timm():
    """timm: targets = lam*smooth(y1) + (1-lam)*smooth(y2), loss = -sum(t * log_softmax)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 5))
    y = rng.integers(0, 5, 6)
    lam, s, n = 0.37, 0.1, 5
    smooth = lambda lab: np.eye(n)[lab] * (1 - s) + s / n  # noqa: E731
    t = lam * smooth(y) + (1 - lam) * smooth(y[::-1])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ref = -(t * logp).sum(1)
    soft = lam * np.eye(n)[y] + (1 - lam) * np.eye(n)[y[::-1]]
    got = steps_lib.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(soft, jnp.float32), s)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_train_step_with_mixup_trains_and_is_deterministic():
    x, y = _batch()
    batch = {"image": jnp.asarray(x), "label": jnp.asarray(y)}
    c = tiny_demo_config(mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode="elem", random_erase_prob=0.5)
    runs = []
    for _ in range(2):
        step, s = _tiny_step(batch_aug.make(c, _spec(c, 5)))
        for _ in range(3):
            s, m = step(s, batch)
        runs.append((s, m.compute()))
    assert np.isfinite(runs[0][1]["loss"])
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------- random erasing

def _ref_box(h, w, p, i, prob):
    """timm RandomErasing._erase for row i with the given uniforms, float64."""
    if not p["apply"][i] < prob:
        return None
    for a in range(erasing.ATTEMPTS):
        target = float(p["area"][i, a]) * h * w
        r = math.exp(float(p["log_ratio"][i, a]))
        bh, bw = int(round(math.sqrt(target * r))), int(round(math.sqrt(target / r)))
        if bw < w and bh < h:
            top = min(int(float(p["top"][i]) * (h - bh + 1)), h - bh)
            left = min(int(float(p["left"][i]) * (w - bw + 1)), w - bw)
            return top, left, bh, bw
    return None


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_random_erasing_matches_the_reference(mode):
    b, h, w = 64, 12, 20
    cfg = erasing.EraseConfig(prob=0.7, mode=mode)
    x = np.random.default_rng(1).uniform(5.0, 6.0, (b, h, w, 3)).astype(np.float32)  # never 0/noise-like
    p = erasing.draw(jax.random.key(0), x.shape, cfg)
    got = np.asarray(jax.jit(erasing.apply, static_argnums=2)(x, p, cfg))
    p = {k: np.asarray(v) for k, v in p.items()}
    fills, n_erased = [], 0
    for i in range(b):
        box = _ref_box(h, w, p, i, cfg.prob)
        want = np.zeros((h, w), bool)
        if box is not None:
            top, left, bh, bw = box
            want[top:top + bh, left:left + bw] = True
            area, ratio = bh * bw / (h * w), bh / bw
            assert 0.02 * 0.5 <= area <= 1 / 3 * 1.5 and 0.3 / 2 <= ratio <= 3.34 * 2  # rounding
            n_erased += 1
        changed = (got[i] != x[i]).any(-1)
        np.testing.assert_array_equal(changed, want, err_msg=f"row {i}")
        np.testing.assert_array_equal(got[i][~want], x[i][~want])  # outside untouched
        if box is not None:
            region = got[i][want]
            if mode == "const":
                np.testing.assert_array_equal(region, 0.0)
            elif mode == "rand":  # one value per channel
                np.testing.assert_array_equal(region, np.broadcast_to(region[0], region.shape))
            fills.append(region.reshape(-1, 3))
    assert 0.5 * b * cfg.prob < n_erased <= b
    if mode == "pixel":  # per-pixel standard normal noise
        f = np.concatenate(fills).ravel().astype(np.float64)
        assert f.size > 2000
        np.testing.assert_allclose(f.mean(), 0.0, atol=4 / math.sqrt(f.size))
        np.testing.assert_allclose(f.std(), 1.0, atol=0.05)


def test_random_erasing_box_distribution():
    """Over many draws the boxes' area fraction and log aspect ratio have the distribution of the
    reference procedure simulated with numpy's own generator (first fitting of 10 attempts)."""
    h = w = 32
    n = 4000
    p = erasing.draw(jax.random.key(1), (n, h, w, 1), erasing.EraseConfig(prob=1.0))
    e, _, _, bh, bw = (np.asarray(v, np.float64) for v in erasing.boxes(h, w, p, 1.0))
    rng = np.random.default_rng(0)
    sim = {"apply": np.zeros(n), "area": rng.uniform(0.02, 1 / 3, (n, 10)),
           "log_ratio": rng.uniform(math.log(0.3), math.log(1 / 0.3), (n, 10)),
           "top": np.zeros(n), "left": np.zeros(n)}
    ref = np.array([_ref_box(h, w, sim, i, 1.0)[2:] for i in range(n)], np.float64)
    assert e.all()
    for got, want in ((bh * bw / (h * w), ref[:, 0] * ref[:, 1] / (h * w)),
                      (np.log(bh / bw), np.log(ref[:, 0] / ref[:, 1]))):
        tol = 4 * want.std() / math.sqrt(n) * math.sqrt(2)
        np.testing.assert_allclose(got.mean(), want.mean(), atol=tol)
        np.testing.assert_allclose(got.std(), want.std(), rtol=0.06)

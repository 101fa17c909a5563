"""init_from with state dicts written by the methods' ORIGINAL PyTorch code (their norm modules'
own parameter names inside timm's ViT names): models/original_norms.py renames them.

CI tests (no torch): tiny random state dicts (tests/test_pretrained_timm.timm_sd: depth 2, width 8,
2 heads, patch 4, 16 px) whose norm tensors carry the originals' names and torch shapes, written as
.safetensors; every norm leaf is compared with the value it must hold (exactly: renames, (1,) -> ()
reshapes, DTN's transposed pos_proj), and the eval logits with a float64 numpy forward of the
original's formula where it is cheap (RepBN's eval affine, DyT, Derf, LearnableScaler) at
rtol = atol = 1e-4 (float32 model vs float64 reference).
Torch tests (skipped without torch/timm or without NORMVIT_ORIGINALS, a folder holding the original
repositories checked out under their GitHub names, DIR/SLAB, ...: benchmarks.originals' --src): the original model built from the original file
(tests/originals_runner.py, in its own process), its state dict loaded here, eval logits within 1e-4.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import save_file
from scipy.special import erf

from normvit_jax import models, pretrained
from normvit_jax.norms.progressive import n1_weight
from tests.test_pretrained_timm import D, DEPTH, H, MLP, NCLS, P, reference, timm_sd

SLOTS = [f"blocks.{i}.norm{j}" for i in range(DEPTH) for j in (1, 2)] + ["norm"]
HERE = os.path.dirname(os.path.abspath(__file__))


def with_norms(seed: int, make) -> dict[str, np.ndarray]:
    """timm_sd with every norm slot's LayerNorm tensors replaced by ``make(rng)`` (relative names)."""
    sd = {k: v for k, v in timm_sd(seed).items()
          if not any(k.startswith(s + ".") for s in SLOTS)}
    r = np.random.default_rng(seed + 100)
    for s in SLOTS:
        sd.update({f"{s}.{k}": np.asarray(v) for k, v in make(r).items()})
    return sd


def n(r, *shape, sd=0.3, mean=0.0):
    return (mean + r.normal(size=shape) * sd).astype(np.float32)


def repbn_tensors(r) -> dict[str, np.ndarray]:
    """SLAB's RepBN (prepbn.py): alpha (1,), bn = BatchNorm1d(C)."""
    return {"alpha": n(r, 1, mean=0.5), "bn.weight": n(r, D, mean=1.0), "bn.bias": n(r, D),
            "bn.running_mean": n(r, D), "bn.running_var": (0.5 + r.random(D)).astype(np.float32),
            "bn.num_batches_tracked": np.asarray(123, np.int64)}


def linear_norm_tensors(r, it: int = 250, total: int = 1000, warm: int = 0):
    """SLAB's LinearNorm(norm1=LayerNorm eps 1e-6, norm2=RepBN) with its step buffers."""
    out = {"norm1.weight": n(r, D, mean=1.0), "norm1.bias": n(r, D),
           "iter": np.asarray(it, np.int64), "total_step": np.asarray(total, np.int64),
           "warm": np.asarray(warm, np.int64)}
    out.update({f"norm2.{k}": v for k, v in repbn_tensors(r).items()})
    return out


def build(norm, image: int = 16, **model):
    cfg = dict(name="vit", patch_size=P, hidden_size=D, depth=DEPTH, num_heads=H, mlp_dim=MLP,
               gelu_approximate=False, norm=norm, **model)
    spec = models.spec_of(cfg, NCLS)
    net = models.create(spec)
    x = jnp.asarray(np.random.default_rng(99).normal(size=(3, image, image, 3)), jnp.float32)
    return spec, net, net.init(jax.random.PRNGKey(0), x), x


def load(tmp_path, sd, norm, **model):
    path = tmp_path / "original.safetensors"
    save_file(sd, str(path))
    spec, net, v, x = build(norm, **model)
    params, stats, rows = pretrained.init_from_checkpoint(
        v["params"], v.get("batch_stats"), str(path), spec, NCLS, log=None)
    var = {"params": params} | ({"batch_stats": stats} if stats is not None else {})
    flat = traverse_util.flatten_dict(params, sep="/")
    flat_stats = traverse_util.flatten_dict(stats, sep="/") if stats is not None else {}
    return net, var, x, flat, flat_stats, rows


def slot_name(s: str) -> str:
    """timm slot -> this model's slot path."""
    if s == "norm":
        return "Transformer/encoder_norm"
    i, j = s.split(".")[1], s[-1]
    return f"Transformer/encoderblock_{i}/LayerNorm_{0 if j == '1' else 2}"


def logits(net, var, x) -> np.ndarray:
    return np.asarray(net.apply(var, x, train=False))


# ----------------------------------------------------------------------------- SLAB RepBN

def repbn_eval(x, f, p):
    """torch BatchNorm1d eval (eps 1e-5) + alpha * x: SLAB RepBN.forward in eval."""
    return ((x - f[p + ".bn.running_mean"]) / np.sqrt(f[p + ".bn.running_var"] + 1e-5)
            * f[p + ".bn.weight"] + f[p + ".bn.bias"] + f[p + ".alpha"][0] * x)


def test_slab_repbn_alpha_is_eta_and_bn_loads_with_its_statistics(tmp_path):
    sd = with_norms(1, repbn_tensors)
    net, var, x, flat, stats, rows = load(tmp_path, sd, "repbn")
    for s in SLOTS:
        t = slot_name(s)
        assert flat[f"{t}/eta"].shape == ()                       # (1,) -> ()
        np.testing.assert_array_equal(flat[f"{t}/eta"], sd[f"{s}.alpha"][0])
        np.testing.assert_array_equal(flat[f"{t}/bn/scale"], sd[f"{s}.bn.weight"])
        np.testing.assert_array_equal(flat[f"{t}/bn/bias"], sd[f"{s}.bn.bias"])
        np.testing.assert_array_equal(stats[f"{t}/bn/mean"], sd[f"{s}.bn.running_mean"])
        np.testing.assert_array_equal(stats[f"{t}/bn/var"], sd[f"{s}.bn.running_var"])
    assert any(r.param.endswith("LayerNorm_0/eta") and "alpha -> eta" in r.note for r in rows)
    want = reference(sd, np.asarray(x), norm=repbn_eval)
    np.testing.assert_allclose(logits(net, var, x), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- SLAB LinearNorm (PRepBN)

def test_slab_linear_norm_loads_into_progressive_and_its_counter_is_reported(tmp_path):
    sd = with_norms(2, linear_norm_tensors)
    net, var, x, flat, stats, rows = load(tmp_path, sd, "progressive")
    for s in SLOTS:
        t = slot_name(s)
        np.testing.assert_array_equal(flat[f"{t}/n1/scale"], sd[f"{s}.norm1.weight"])
        np.testing.assert_array_equal(flat[f"{t}/n1/bias"], sd[f"{s}.norm1.bias"])
        np.testing.assert_array_equal(flat[f"{t}/n2/eta"], sd[f"{s}.norm2.alpha"][0])
        np.testing.assert_array_equal(flat[f"{t}/n2/bn/scale"], sd[f"{s}.norm2.bn.weight"])
        np.testing.assert_array_equal(stats[f"{t}/n2/bn/var"], sd[f"{s}.norm2.bn.running_var"])
    dropped = {r.param.rsplit("/", 1)[-1]: r.note for r in rows if r.action == "dropped"}
    assert "decay_steps=250" in dropped["iter"] and "r0=0.25" in dropped["iter"]
    assert {"warm", "total_step"} <= set(dropped)
    # LinearNorm evaluates norm2 alone (RepBN): so does eval_mode='n2'
    want = reference(sd, np.asarray(x), norm=lambda x, f, p: repbn_eval(x, f, p + ".norm2"))
    np.testing.assert_allclose(logits(net, var, x), want, rtol=1e-4, atol=1e-4)


def test_slab_linear_norm_into_repbn_takes_n2_and_drops_n1(tmp_path):
    """The hand-over's end state (what LinearNorm evaluates at any step): RepBN alone."""
    sd = with_norms(3, linear_norm_tensors)
    net, var, x, flat, stats, rows = load(tmp_path, sd, "repbn")
    for s in SLOTS:
        t = slot_name(s)
        np.testing.assert_array_equal(flat[f"{t}/eta"], sd[f"{s}.norm2.alpha"][0])
        np.testing.assert_array_equal(stats[f"{t}/bn/mean"], sd[f"{s}.norm2.bn.running_mean"])
    n1 = [r for r in rows if "/n1/" in r.param]
    assert n1 and all(r.action == "dropped" and "N1 of the hand-over" in r.note for r in n1)
    want = reference(sd, np.asarray(x), norm=lambda x, f, p: repbn_eval(x, f, p + ".norm2"))
    np.testing.assert_allclose(logits(net, var, x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("it,total,warm,r0", [(250, 1000, 0, 1.0), (700, 900, 5, 0.8)])
def test_reported_schedule_continues_linear_norm_step_for_step(it, total, warm, r0):
    """The report's continuation (progressive r0'=r0*iter/total, decay_steps=iter,
    warmup_steps=warm) against LinearNorm.forward's counters, emulated forward by forward."""
    lam_orig, w, i = [], warm, it
    for _ in range(warm + it + 5):
        if w > 0:
            w -= 1
            lam_orig.append(1.0)
        else:
            lam_orig.append(r0 * i / total)
            i = max(i - 1, 0) if i > 0 else i
    ours = [float(n1_weight(jnp.asarray(float(k)), r0=r0 * it / total, warmup_steps=warm,
                            decay_steps=it, schedule="linear")) for k in range(len(lam_orig))]
    np.testing.assert_allclose(ours, lam_orig, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- DyT, Derf

@pytest.mark.parametrize("name", ["dyt", "derf"])
def test_dyt_derf_scalars_load_as_scalars(tmp_path, name):
    def make(r):
        t = {"alpha": n(r, 1, mean=0.5), "weight": n(r, D, mean=1.0), "bias": n(r, D)}
        if name == "derf":
            t["shift"] = n(r, 1, sd=0.2)
        return t

    def pointwise(x, f, p):
        if name == "dyt":   # DynamicTanh.forward
            return np.tanh(f[p + ".alpha"][0] * x) * f[p + ".weight"] + f[p + ".bias"]
        return erf(f[p + ".alpha"][0] * x + f[p + ".shift"][0]) * f[p + ".weight"] + f[p + ".bias"]

    sd = with_norms(4, make)
    net, var, x, flat, _, rows = load(tmp_path, sd, name)
    for s in SLOTS:
        t = slot_name(s)
        for k in ("alpha", "shift") if name == "derf" else ("alpha",):
            assert flat[f"{t}/{k}"].shape == ()
            np.testing.assert_array_equal(flat[f"{t}/{k}"], sd[f"{s}.{k}"][0])
        np.testing.assert_array_equal(flat[f"{t}/scale"], sd[f"{s}.weight"])
    assert not [r for r in rows if r.action in ("init", "dropped")]
    want = reference(sd, np.asarray(x), norm=pointwise)
    np.testing.assert_allclose(logits(net, var, x), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- LearnableScaler

def test_learnable_scaler_a_b_are_scale_bias(tmp_path):
    sd = with_norms(5, lambda r: {"a": n(r, D, sd=1.0), "b": n(r, D)})
    net, var, x, flat, _, _ = load(tmp_path, sd, "learnable_scaler")
    for s in SLOTS:
        np.testing.assert_array_equal(flat[f"{slot_name(s)}/scale"], sd[f"{s}.a"])
        np.testing.assert_array_equal(flat[f"{slot_name(s)}/bias"], sd[f"{s}.b"])
    want = reference(sd, np.asarray(x), norm=lambda x, f, p: f[p + ".a"] * x + f[p + ".b"])
    np.testing.assert_allclose(logits(net, var, x), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- DTN, PowerNorm

def test_dtn_gates_and_position_map(tmp_path):
    """DTN (normkit/norms/dtn.py): gates renamed, pos_proj.weight (H, 3) transposed to (3, H),
    pos_proj.bias reported as dropped (a per-head constant under a softmax)."""
    def make(r):
        return {"weight": n(r, D, mean=1.0), "bias": n(r, D), "mean_norm_weight": n(r, H),
                "var_norm_weight": n(r, H), "pos_proj.weight": n(r, H, 3), "pos_proj.bias": n(r, H)}
    sd = with_norms(6, make)
    _, _, _, flat, _, rows = load(tmp_path, sd, {"name": "dtn", "epsilon": 1e-5})
    for s in SLOTS:
        t = slot_name(s)
        np.testing.assert_array_equal(flat[f"{t}/pos_proj"], sd[f"{s}.pos_proj.weight"].T)
        np.testing.assert_array_equal(flat[f"{t}/mean_gate"], sd[f"{s}.mean_norm_weight"])
        np.testing.assert_array_equal(flat[f"{t}/var_gate"], sd[f"{s}.var_norm_weight"])
        np.testing.assert_array_equal(flat[f"{t}/scale"], sd[f"{s}.weight"])
    bias = [r for r in rows if r.param.endswith("pos_proj_bias")]
    assert bias and all(r.action == "dropped" and "softmax" in r.note for r in bias)


def test_powernorm_buffers_load_into_batch_stats(tmp_path):
    """The DTN repository's PowerNorm: running_phi, ema_gz (1, C, 1, 1) -> (C,), iters -> t."""
    def make(r):
        return {"weight": n(r, D, mean=1.0), "bias": n(r, D),
                "running_phi": (0.5 + r.random((1, D, 1, 1))).astype(np.float32),
                "ema_gz": n(r, 1, D, 1, 1), "iters": np.asarray([4321], np.int64)}
    sd = with_norms(7, make)
    _, _, _, flat, stats, _ = load(tmp_path, sd, "powernorm")
    for s in SLOTS:
        t = slot_name(s)
        np.testing.assert_array_equal(stats[f"{t}/running_phi"], sd[f"{s}.running_phi"].reshape(D))
        np.testing.assert_array_equal(stats[f"{t}/ema_gz"], sd[f"{s}.ema_gz"].reshape(D))
        assert float(stats[f"{t}/t"]) == 4321.0
        np.testing.assert_array_equal(flat[f"{t}/scale"], sd[f"{s}.weight"])


# --------------------------------------------------------- the originals' own code (torch)

ORIGINALS = os.environ.get("NORMVIT_ORIGINALS")
LN5 = {"name": "layernorm", "epsilon": 1e-5}
ORIGINAL_MODELS = {  # runner method -> (this model's config, image size)
    "slab_repbn": (dict(patch_size=8, norm={"name": "repbn"}), 32),
    "slab_progressive": (dict(patch_size=8, norm={"name": "progressive"}), 32),
    "slab_progressive:repbn": (dict(patch_size=8, norm={"name": "repbn"}), 32),
    "dyt": (dict(patch_size=8, norm={"name": "dyt"}), 32),
    "derf": (dict(patch_size=8, norm={"name": "derf"}), 32),
    "dyt_avg": (dict(patch_size=8, norm={"name": "dyt"}, classifier="token_gap_fc_norm"), 32),
    "derf_avg": (dict(patch_size=8, norm={"name": "derf"}, classifier="token_gap_fc_norm"), 32),
    "learnable_scaler": (dict(patch_size=8, norm={"name": "learnable_scaler"}), 32),
    # vit_norm_mix.py: DTN in blocks 0-1, the class token joining at block 2 (no posemb), LN after
    "dtn": (dict(patch_size=4, depth=3, qkv_bias=False, cls_token_at_block=2,
                 norm={"name": "dtn", "epsilon": 1e-5},
                 norm_overrides={"last_1": LN5, "final": LN5}), 56),
    "dtn_powernorm": (dict(patch_size=4, depth=3, qkv_bias=False, cls_token_at_block=2,
                           norm={"name": "powernorm", "groups": "heads", "warmup": 3000},
                           norm_overrides={"last_1": LN5, "final": LN5}), 56),
}


@pytest.mark.skipif(not ORIGINALS, reason="NORMVIT_ORIGINALS (the original repositories) not set")
@pytest.mark.parametrize("case", list(ORIGINAL_MODELS))
def test_original_models_logits(tmp_path, case):
    pytest.importorskip("torch")
    pytest.importorskip("timm")
    method = case.split(":")[0]
    subprocess.run([sys.executable, os.path.join(HERE, "originals_runner.py"), method, ORIGINALS,
                    str(tmp_path)], check=True, capture_output=True)
    cfg, image = ORIGINAL_MODELS[case]
    cfg = dict(name="vit", hidden_size=16, depth=2, num_heads=2, mlp_dim=64,
               gelu_approximate=False) | cfg
    spec = models.spec_of(cfg, NCLS)
    net = models.create(spec)
    images = np.load(tmp_path / "images.npy")
    v = net.init(jax.random.PRNGKey(0), jnp.asarray(images[:1]))
    params, stats, _ = pretrained.init_from_checkpoint(
        v["params"], v.get("batch_stats"), str(tmp_path / "model.safetensors"), spec, NCLS, log=None)
    var = {"params": params} | ({"batch_stats": stats} if stats is not None else {})
    got = np.asarray(net.apply(var, jnp.asarray(images), train=False))
    want = np.load(tmp_path / "logits.npy")
    print(f"{case}: max |logit difference| {np.abs(got - want).max():.2e} "
          f"(max |logit| {np.abs(want).max():.2f})")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key,words", [
    ("to_patch_embedding.1.weight", "DTN repository's models/vit_norm.py"),
    ("transformer.embeddings.patch_embeddings.weight", "RescaleViT"),
    ("tokens_to_token.attention1.kqv.weight", "T2T-ViT"),
])
def test_other_layouts_of_the_originals_are_refused_in_one_line(tmp_path, key, words):
    path = tmp_path / "other.safetensors"
    save_file({key: np.ones((4, 4), np.float32), "head.weight": np.ones((5, 4), np.float32)},
              str(path))
    spec, _, v, _ = build("layernorm")
    with pytest.raises(pretrained.CheckpointError) as e:
        pretrained.init_from_checkpoint(v["params"], None, str(path), spec, NCLS, log=None)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_progressive_export_into_repbn_takes_n2(tmp_path):
    """An .npz of a `progressive` model (vit_jax names, as export writes them) into `repbn`:
    the same hand-over rule as SLAB's LinearNorm (N2's tensors, N1's dropped)."""
    _, _, v, _ = build("progressive")
    flat = traverse_util.flatten_dict(v["params"], sep="/")
    r = np.random.default_rng(8)
    flat = {k: np.asarray(a) + r.normal(size=np.shape(a)).astype(np.float32) for k, a in flat.items()}
    np.savez(tmp_path / "prog.npz", **flat)
    spec, _, w, _ = build("repbn")
    params, rows = pretrained.init_from_npz(w["params"], str(tmp_path / "prog.npz"), spec, NCLS,
                                            log=None)
    got = traverse_util.flatten_dict(params, sep="/")
    for s in SLOTS:
        t = slot_name(s)
        np.testing.assert_array_equal(got[f"{t}/eta"], flat[f"{t}/n2/eta"])
        np.testing.assert_array_equal(got[f"{t}/bn/scale"], flat[f"{t}/n2/bn/scale"])
    assert all(r.action == "dropped" for r in rows if "/n1/" in r.param)

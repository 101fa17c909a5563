"""init_from with timm / PyTorch ViT state dicts, on tiny random ones written here (depth 2, width 8,
2 heads, patch 4, 16 px) in timm's names and shapes.

The reference is independent of the loader: a float64 numpy forward of timm's VisionTransformer
read from the raw state-dict tensors (conv as a patch reshape, LayerNorm eps 1e-6, the fused qkv
split, softmax attention, exact erf GELU, token or average pooling), posemb resizing by separable
np.interp (corner-aligned, what this loader documents). Tolerance: float32 model vs float64
reference, rtol=atol=1e-4. Only the last test needs torch/timm (skipped without them).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from scipy.special import erf

from normvit_jax import cli, models, pretrained, state_dict

D, H, MLP, P, DEPTH, NCLS = 8, 2, 16, 4, 2, 5
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timm_sd(seed: int, *, cls: bool = True, slot: bool = True, fc_norm: bool = False,
            grid: int = 4, depth: int = DEPTH) -> dict[str, np.ndarray]:
    """Random weights under timm's VisionTransformer names and torch shapes."""
    r = np.random.default_rng(seed)
    n = lambda *s, sd=0.4: (r.normal(size=s) * sd).astype(np.float32)  # noqa: E731
    sd = {"patch_embed.proj.weight": n(D, 3, P, P), "patch_embed.proj.bias": n(D),
          "pos_embed": n(1, grid * grid + int(cls and slot), D),
          "head.weight": n(NCLS, D), "head.bias": n(NCLS)}
    if cls:
        sd["cls_token"] = n(1, 1, D)
    final = "fc_norm" if fc_norm else "norm"
    sd[f"{final}.weight"], sd[f"{final}.bias"] = 1 + n(D, sd=0.2), n(D)
    for i in range(depth):
        b = f"blocks.{i}."
        sd.update({b + "norm1.weight": 1 + n(D, sd=0.2), b + "norm1.bias": n(D),
                   b + "attn.qkv.weight": n(3 * D, D), b + "attn.qkv.bias": n(3 * D),
                   b + "attn.proj.weight": n(D, D), b + "attn.proj.bias": n(D),
                   b + "norm2.weight": 1 + n(D, sd=0.2), b + "norm2.bias": n(D),
                   b + "mlp.fc1.weight": n(MLP, D), b + "mlp.fc1.bias": n(MLP),
                   b + "mlp.fc2.weight": n(D, MLP), b + "mlp.fc2.bias": n(D)})
    return sd


def resize(grid: np.ndarray, new: int) -> np.ndarray:
    """Corner-aligned bilinear resize of a (g, g, D) grid, separable np.interp, float64."""
    g = grid.shape[0]
    pos = np.arange(new) * (g - 1) / (new - 1)
    rows = np.stack([[np.interp(pos, np.arange(g), grid[:, j, d]) for d in range(grid.shape[2])]
                     for j in range(g)], 0).transpose(2, 0, 1)          # (new, g, D)
    return np.stack([[np.interp(pos, np.arange(g), rows[i, :, d]) for d in range(grid.shape[2])]
                     for i in range(new)], 0).transpose(0, 2, 1)        # (new, new, D)


def reference(sd: dict[str, np.ndarray], images: np.ndarray, *, slot: bool = True,
              pool: str = "token", norm=None) -> np.ndarray:
    """timm's VisionTransformer.forward (eval) in float64 from the raw state dict; images NHWC.
    ``norm(x, f, prefix)``: another norm module's eval (f: the float64 state dict)."""
    f = {k: np.asarray(v, np.float64) for k, v in sd.items()}

    def ln(x: np.ndarray, p: str) -> np.ndarray:
        """timm's LayerNorm (eps 1e-6), or torch's BatchNorm1d in eval (eps 1e-5) where the state
        dict holds running statistics for it."""
        if norm is not None:
            return norm(x, f, p)
        if p + ".running_mean" in f:
            return ((x - f[p + ".running_mean"]) / np.sqrt(f[p + ".running_var"] + 1e-5)
                    * f[p + ".weight"] + f[p + ".bias"])
        return ((x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
                * f[p + ".weight"] + f[p + ".bias"])

    lin = lambda x, p: x @ f[p + ".weight"].T + f[p + ".bias"]  # noqa: E731
    x = images.astype(np.float64).transpose(0, 3, 1, 2)               # NCHW, as torch
    b, c, hh, ww = x.shape
    gh, gw = hh // P, ww // P
    patches = x.reshape(b, c, gh, P, gw, P).transpose(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, -1)
    x = patches @ f["patch_embed.proj.weight"].reshape(D, -1).T + f["patch_embed.proj.bias"]
    pe = f["pos_embed"]
    pe_cls, pe_grid = (pe[:, :1], pe[:, 1:]) if slot and "cls_token" in f else (None, pe)
    g = math.isqrt(pe_grid.shape[1])
    if g != gh:
        pe_grid = resize(pe_grid[0].reshape(g, g, D), gh).reshape(1, gh * gw, D)
    if "cls_token" in f:
        cls = np.broadcast_to(f["cls_token"], (b, 1, D))
        if pe_cls is not None:
            x = np.concatenate([cls, x], 1) + np.concatenate([pe_cls, pe_grid], 1)
        else:  # no_embed_class: the class token gets no position embedding
            x = np.concatenate([cls, x + pe_grid], 1)
    else:
        x = x + pe_grid
    for i in range(len({k.split(".")[1] for k in f if k.startswith("blocks.")})):
        p = f"blocks.{i}."
        y = ln(x, p + "norm1")
        qkv = lin(y, p + "attn.qkv").reshape(b, -1, 3, H, D // H).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv
        a = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D // H)
        a = np.exp(a - a.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = (a @ v).transpose(0, 2, 1, 3).reshape(b, -1, D)
        x = x + lin(o, p + "attn.proj")
        h1 = lin(ln(x, p + "norm2"), p + "mlp.fc1")
        x = x + lin(0.5 * h1 * (1 + erf(h1 / math.sqrt(2))), p + "mlp.fc2")
    if pool == "token":
        x = ln(x, "norm")[:, 0]
    else:  # global_pool='avg' over the patch tokens, then fc_norm
        x = ln(x[:, int("cls_token" in f):].mean(1), "fc_norm")
    return lin(x, "head")


def build(image: int = 16, **model):
    cfg = dict(name="vit", patch_size=P, hidden_size=D, depth=DEPTH, num_heads=H, mlp_dim=MLP,
               gelu_approximate=False, **model)
    spec = models.spec_of(cfg, NCLS)
    net = models.create(spec)
    x = jnp.asarray(np.random.default_rng(99).normal(size=(3, image, image, 3)), jnp.float32)
    return spec, net, net.init(jax.random.PRNGKey(0), x)["params"], x


def load(params, path, spec, **kw):
    return pretrained.init_from_npz(params, str(path), spec, NCLS, log=None, **kw)


# ------------------------------------------------------------------------------------ logits

CLASSIFIER = {"avg_fc_norm": "gap_fc_norm", "token_avg_fc_norm": "token_gap_fc_norm"}


@pytest.mark.parametrize("case", ["token", "no_embed_class", "avg_fc_norm", "token_avg_fc_norm",
                                  "bfloat16"])
def test_logits_match_float64_timm_forward(tmp_path, case):
    """Token pooling with and without the posemb class slot, average pooling with fc_norm
    without a class token (classifier='gap_fc_norm') and with one (timm's global_pool='avg'
    default: the class token attends, the mean is over the patch tokens only;
    'token_gap_fc_norm'), and a bfloat16 file (widened exactly: the reference reads the same
    widened values)."""
    slot = case != "no_embed_class"
    avg = case in CLASSIFIER
    sd = timm_sd(1, slot=slot, cls=case != "avg_fc_norm", fc_norm=avg)
    if case == "bfloat16":
        sd = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, net, params, x = build(classifier=CLASSIFIER.get(case, "token"))
    new, rows = load(params, tmp_path / "m.safetensors", spec)
    assert {r.action for r in rows} == {"loaded"}, [r for r in rows if r.action != "loaded"]
    got = np.asarray(net.apply({"params": new}, x))
    want = reference({k: v.astype(np.float32) for k, v in sd.items()}, np.asarray(x), slot=slot,
                     pool="avg" if avg else "token")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 0.5  # logits of a size that a wrong weight would change


def test_avg_pool_with_class_token_maps_to_token_gap_fc_norm(tmp_path):
    """A timm file with cls_token and fc_norm (global_pool='avg', class token): into
    'token_gap_fc_norm' the class token and fc_norm load under their own names; a 'token' or
    'gap' model stops with a first error naming that classifier; a 'gap_fc_norm' model loads a
    fine-tune start whose report names it; 'token_gap_fc_norm' without a class token in the file
    names 'gap_fc_norm'. The pooling itself: test_logits_match_float64_timm_forward."""
    path = tmp_path / "m.safetensors"
    save_file(timm_sd(2, fc_norm=True), str(path))
    spec, _, params, _ = build(classifier="token_gap_fc_norm")
    _, rows = load(params, path, spec)
    got = {r.param: (r.action, r.source) for r in rows}
    assert got["cls"] == ("loaded", "cls")
    assert got["fc_norm/scale"] == ("loaded", "fc_norm/scale")
    assert not any(p.startswith("Transformer/encoder_norm") for p in got)
    for classifier in ("token", "gap"):
        spec, _, params, _ = build(classifier=classifier)
        with pytest.raises(pretrained.CheckpointError, match=r"^cannot load init_from \S+: the "
                           r"checkpoint's final norm is fc_norm \(timm's global_pool='avg'\): set "
                           r"model\.classifier='token_gap_fc_norm';"):
            load(params, path, spec)
    spec, _, params, _ = build(classifier="gap_fc_norm")
    _, rows = load(params, path, spec)
    (drop,) = [r for r in rows if r.action == "dropped"]
    assert drop.param == "cls" and "model.classifier='token_gap_fc_norm'" in drop.note
    save_file(timm_sd(2, cls=False, fc_norm=True), str(path))
    spec, _, params, _ = build(classifier="token_gap_fc_norm")
    with pytest.raises(pretrained.CheckpointError, match="set model.classifier='gap_fc_norm'"):
        load(params, path, spec)


def test_a_remote_safetensors_file_is_read_through_epath(tmp_path, monkeypatch):
    """gs:// (any path etils.epath opens, as for the .npz files): the bytes are copied to a local
    file for safetensors' reader, which takes local paths only; bfloat16 included."""
    sd = {k: v.astype(ml_dtypes.bfloat16) if k.endswith("weight") else v
          for k, v in timm_sd(2).items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    real_path = state_dict.epath.Path

    def remote(p):  # gs://bucket/m.safetensors -> the local file (no network here)
        return real_path(str(tmp_path / "m.safetensors") if str(p).startswith("gs://") else p)
    monkeypatch.setattr(state_dict.epath, "Path", remote)
    got, note = state_dict.read("gs://bucket/m.safetensors")
    assert sorted(got) == sorted(sd) and "bfloat16" in note
    for k, v in sd.items():
        np.testing.assert_array_equal(got[k], v.astype(np.float32), err_msg=k)


def test_posemb_resampled_to_another_image_size(tmp_path):
    """A 16 px file (4x4 grid) into a 24 px model (6x6): the grid is resized, the class slot kept."""
    sd = timm_sd(2)
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, net, params, x = build(image=24)
    new, rows = load(params, tmp_path / "m.safetensors", spec, image_size=24)
    pe_row = next(r for r in rows if r.param.endswith("pos_embedding"))
    assert pe_row.action == "resampled" and "4x4 -> 6x6" in pe_row.note
    np.testing.assert_allclose(np.asarray(net.apply({"params": new}, x)),
                               reference(sd, np.asarray(x)), rtol=1e-4, atol=1e-4)


def test_head_of_another_class_count_is_zeroed_and_stats_reported(tmp_path):
    """A 7-class head into a 5-class model: zeros (the existing rule); a BatchNorm's running
    statistic in a LayerNorm slot is reported as dropped, not silently ignored."""
    sd = timm_sd(3)
    sd["head.weight"], sd["head.bias"] = np.ones((7, D), np.float32), np.ones(7, np.float32)
    sd["blocks.0.norm1.running_mean"] = np.ones(D, np.float32)
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    new, rows = load(params, tmp_path / "m.safetensors", spec)
    head = [r for r in rows if r.param.startswith("head/")]
    assert [r.action for r in head] == ["reinit", "reinit"] and not np.any(new["head"]["kernel"])
    stat = [r for r in rows if r.action == "dropped"]
    assert len(stat) == 1 and "running statistics are not loaded" in stat[0].note


@pytest.mark.parametrize("scan", [False, True], ids=["per_block", "scanned"])
def test_batchnorm_running_statistics_load_into_batch_stats(tmp_path, scan):
    """A BatchNorm ViT in timm's names (norm1/norm2/norm with running_mean/var, as torch's
    BatchNorm1d saves them) into model.norm='batchnorm': eval logits match torch's BN eval
    formula; with init_from_npz (no batch_stats) the statistics are reported as dropped."""
    sd = timm_sd(9)
    r = np.random.default_rng(10)
    for p in [f"blocks.{i}.{n}" for i in range(DEPTH) for n in ("norm1", "norm2")] + ["norm"]:
        sd[p + ".running_mean"] = r.normal(size=D).astype(np.float32)
        sd[p + ".running_var"] = r.uniform(0.5, 2.0, size=D).astype(np.float32)
        sd[p + ".num_batches_tracked"] = np.array(100, np.int64)
    path = tmp_path / "bn.safetensors"
    save_file(sd, str(path))
    spec, net, _, x = build(norm="batchnorm", scan=scan)
    variables = net.init(jax.random.PRNGKey(0), x)
    params, stats, rows = pretrained.init_from_checkpoint(
        variables["params"], variables["batch_stats"], str(path), spec, NCLS, log=None)
    assert sum(r.param.startswith("batch_stats/") and r.action == "loaded" for r in rows) == 10
    assert {r.note for r in rows if r.action == "dropped"} == {"a step counter, not used"}
    got = np.asarray(net.apply({"params": params, "batch_stats": stats}, x, train=False))
    np.testing.assert_allclose(got, reference(sd, np.asarray(x)), rtol=1e-4, atol=1e-4)
    _, rows = load(variables["params"], path, spec)
    assert sum(r.action == "dropped" and "batch_stats not given" in r.note for r in rows) == 10


def test_loop_init_from_puts_running_statistics_into_the_train_state(tmp_path):
    """The loop's own path (train/build.init_from_pretrained) with a BatchNorm timm file: the
    state's batch_stats are the file's running statistics, on the state's shardings."""
    from flax import traverse_util

    from normvit_jax import sharding
    from normvit_jax.train import build, optimizer, setup
    from tests.conftest import tiny_demo_config

    cfg = tiny_demo_config(**{"model.hidden_size": D, "model.mlp_dim": MLP, "model.patch_size": P,
                              "model.norm": {"name": "batchnorm"}})
    spec = setup.validate_config(cfg, jax.device_count())
    model = setup.create_model(cfg, 10, spec)
    tx, _ = optimizer.create(cfg, 6)
    state, shardings = setup.create_train_state(model, tx, (8, 8, 3), sharding.make_mesh(cfg),
                                                jax.random.key(0))
    sd = timm_sd(11, grid=2)
    r = np.random.default_rng(12)
    for i in range(DEPTH):
        for n in ("norm1", "norm2"):
            sd[f"blocks.{i}.{n}.running_mean"] = r.normal(size=D).astype(np.float32)
            sd[f"blocks.{i}.{n}.running_var"] = r.uniform(0.5, 2, size=D).astype(np.float32)
    save_file(sd, str(tmp_path / "bn.safetensors"))
    cfg.init_from = str(tmp_path / "bn.safetensors")
    new = build.init_from_pretrained(cfg, spec, 10, state, tx, shardings)
    stats = traverse_util.flatten_dict(jax.tree.map(np.asarray, new.batch_stats), sep="/")
    slots = {"norm1": "LayerNorm_0", "norm2": "LayerNorm_2"}
    want = {f"Transformer/encoderblock_{k.split('.')[1]}/{slots[k.split('.')[2]]}/"
            f"{'mean' if k.endswith('mean') else 'var'}": v for k, v in sd.items() if "running" in k}
    assert sorted(want) == sorted(k for k in stats if "encoderblock" in k)
    for k, v in want.items():
        np.testing.assert_array_equal(stats[k], v, err_msg=k)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(new), jax.tree.leaves(shardings)))


def test_tanh_gelu_note_gives_the_trained_magnitude(tmp_path):
    """A timm file into a tanh-GELU model (the default) gets one note naming the fix and what it
    costs: ~5e-4 on random weights, up to ~4e-3 on trained ones (docs/pretrained.md, "Measured
    with trained weights": 3.7e-3 and 3.1e-3 on two small ViTs trained on Fashion-MNIST); an
    exact-GELU model gets none."""
    save_file(timm_sd(3), str(tmp_path / "m.safetensors"))
    for approximate in (True, False):
        spec = models.spec_of(dict(name="vit", patch_size=P, hidden_size=D, depth=DEPTH, num_heads=H,
                                   mlp_dim=MLP, gelu_approximate=approximate), NCLS)
        x = jnp.zeros((1, 16, 16, 3), jnp.float32)
        params = models.create(spec).init(jax.random.PRNGKey(0), x)["params"]
        lines = []
        pretrained.init_from_npz(params, str(tmp_path / "m.safetensors"), spec, NCLS, log=lines.append)
        notes = [ln for ln in lines[0].splitlines() if "GELU" in ln]
        if approximate:
            assert len(notes) == 1 and "gelu_approximate=False reproduces it" in notes[0]
            assert "~5e-4 on random weights, up to ~4e-3 on trained ones" in notes[0]
        else:
            assert notes == []


# ------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("extra, message", [
    ({"blocks.0.ls1.gamma": 0, "blocks.1.ls2.gamma": 0}, r"LayerScale .*\[blocks\.0\.ls1\.gamma and 1 more\]"),
    ({"dist_token": 1, "head_dist.weight": 2}, r"a distillation token .*\[dist_token and 1 more\]"),
    ({"reg_token": 1}, r"register tokens"),
    ({"blocks.0.attn.q_norm.weight": 0}, r"qk-norm"),
], ids=["layerscale", "distilled", "registers", "qk_norm"])
def test_features_this_model_lacks_are_refused_by_name(tmp_path, extra, message):
    sd = timm_sd(4)
    for k, kind in extra.items():
        sd[k] = np.full((1, 1, D) if kind == 1 else ((NCLS, D) if kind == 2 else (D,)), 0.1, np.float32)
    path = tmp_path / "m.safetensors"
    save_file(sd, str(path))
    spec, _, params, _ = build()
    with pytest.raises(pretrained.CheckpointError,
                       match=rf"^cannot load init_from {re.escape(str(path))}: the checkpoint has "
                             rf"what this model lacks: {message}") as e:
        load(params, path, spec)
    assert "\n" not in str(e.value)


def test_wrong_depth_and_corrupt_file_are_one_line(tmp_path):
    spec, _, params, _ = build()
    deep = tmp_path / "deep.safetensors"
    save_file(timm_sd(5, depth=3), str(deep))
    with pytest.raises(pretrained.CheckpointError) as e:
        load(params, deep, spec)
    first = str(e.value).splitlines()[0]
    assert "differs from the checkpoint in depth (checkpoint 3, model 2)" in first
    assert "unexpected in checkpoint: Transformer/encoderblock_2/" in first
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(deep.read_bytes()[:300])  # a truncated download
    with pytest.raises(pretrained.CheckpointError,
                       match=r"^bad\.safetensors|not a readable \.safetensors file") as e:
        load(params, bad, spec)
    assert "\n" not in str(e.value)


def test_pth_without_torch_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "deit.pth"
    path.write_bytes(b"PK\x03\x04 not read")
    monkeypatch.setattr(state_dict, "_has_torch", lambda: False)
    with pytest.raises(ValueError, match=r"needs torch: pip install -e '\.\[torch\]' \(a "
                                         r"\.safetensors file needs no torch"):
        state_dict.check(str(path), key="config.init_from")


def main_py_stopped(path, tmp_path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """main.py (the demo config) starting from ``path``: exit 2 asserted; (the process, its
    'Stopped:' lines). The workdir would be tmp_path/wd."""
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "main.py"),
                        "--config=configs/vit_ln.py:demo", f"--config.init_from={path}",
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=300)
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    return r, [line for line in (r.stdout + r.stderr).splitlines() if "Stopped:" in line]


def test_main_py_refuses_layerscale_in_one_line(tmp_path):
    """End to end (docs/faults.md): exit 2, one 'Stopped:' line naming LayerScale, no workdir."""
    sd = timm_sd(6)
    sd["blocks.0.ls1.gamma"] = np.ones(D, np.float32)
    path = tmp_path / "deit3.safetensors"
    save_file(sd, str(path))
    r, stopped = main_py_stopped(path, tmp_path)
    assert len(stopped) == 1 and "LayerScale" in stopped[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "wd").exists()


# ------------------------------------------------------------------------------------ real timm

@pytest.mark.parametrize("pool, suffix", [("token", ".safetensors"), ("avg", ".pth"),
                                          ("token_avg", ".safetensors")])
def test_real_timm_model_logits(tmp_path, pool, suffix):
    """timm's own VisionTransformer (weights perturbed off its init), saved by safetensors.torch,
    or by torch.save wrapped as DeiT's {'model': state_dict}: this model's logits equal timm's
    eval forward within 1e-4. 'token_avg': global_pool='avg' with timm's default class token and
    fc_norm (DyT's, Derf's ViTs), classifier='token_gap_fc_norm'."""
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file as torch_save_file
    torch.manual_seed(0)
    kw = {"token": {}, "avg": dict(global_pool="avg", class_token=False, fc_norm=True),
          "token_avg": dict(global_pool="avg")}[pool]
    m = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=10, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path / f"m{suffix}"
    if suffix == ".safetensors":
        torch_save_file(m.state_dict(), str(path))
    else:
        torch.save({"model": m.state_dict(), "epoch": 3}, str(path))
    x = np.random.default_rng(7).normal(size=(3, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        want = m(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    spec = models.spec_of(dict(name="vit", patch_size=4, hidden_size=16, depth=2, num_heads=2,
                               mlp_dim=64, gelu_approximate=False,
                               classifier={"token": "token", "avg": "gap_fc_norm",
                                           "token_avg": "token_gap_fc_norm"}[pool]), 10)
    net = models.create(spec)
    params = net.init(jax.random.PRNGKey(0), jnp.asarray(x))["params"]
    new, _ = pretrained.init_from_npz(params, str(path), spec, 10, image_size=32, log=None)
    got = np.asarray(net.apply({"params": new}, jnp.asarray(x)))
    print(f"max |logit diff| vs timm ({pool}, {suffix}): {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_pth_with_pickled_objects_is_refused_in_one_line(tmp_path):
    """A training checkpoint holding argparse args (DeiT's) is refused by weights_only=True: one
    line naming the class and how to save the weights alone; a truncated .pth likewise."""
    torch = pytest.importorskip("torch")
    import argparse
    sd = {k: torch.from_numpy(v) for k, v in timm_sd(8).items()}
    torch.save({"model": sd, "args": argparse.Namespace(lr=5e-4)}, str(tmp_path / "ckpt.pth"))
    spec, _, params, _ = build()
    with pytest.raises(pretrained.CheckpointError, match=r"Python objects besides tensors "
                                                         r"\(argparse\.Namespace\)") as e:
        load(params, tmp_path / "ckpt.pth", spec)
    torch.save({"model": sd}, str(tmp_path / "ok.pth"))
    (tmp_path / "cut.pth").write_bytes((tmp_path / "ok.pth").read_bytes()[:500])
    with pytest.raises(pretrained.CheckpointError, match="not a readable PyTorch file") as e2:
        load(params, tmp_path / "cut.pth", spec)
    assert "\n" not in str(e.value) + str(e2.value)


# ------------------------------------------------------------- notes a fine-tune start needs

def test_input_normalization_note_for_a_timm_file(tmp_path):
    """A timm file loaded for inputs normalized otherwise than timm's ImageNet ViTs were (the
    default minus_one_one of configs/finetune.py) trained 12 points worse with no word; the report
    now says which normalization to check, like the GELU note. The file does not record it: the
    note names both timm conventions and where to read the right one (pretrained_cfg)."""
    save_file(timm_sd(3), str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    for normalize in ("minus_one_one", "zero_one", "imagenet", None):
        lines = []
        pretrained.init_from_checkpoint(params, None, str(tmp_path / "m.safetensors"), spec, NCLS,
                                        normalize=normalize, log=lines.append)
        notes = [ln for ln in lines[0].splitlines() if "normalize" in ln]
        if normalize in ("imagenet", None):
            assert notes == []
        else:
            assert len(notes) == 1 and notes[0].startswith(
                f"  note: inputs are data.normalize={normalize!r}; timm's ViTs trained on ImageNet-1k "
                "(DeiT, the norm methods' originals) expect --config.data.normalize=imagenet")
            assert "Google's ports (augreg, orig_in21k) expect 'minus_one_one'" in notes[0]
            assert "pretrained_cfg['mean']" in notes[0]


def test_head_kept_or_reset_says_why(tmp_path):
    """A head of the model's shape but another dataset's classes loaded silently; the report now
    says why it loaded (or was zeroed), and reset_head (config.init_reset_head) zeroes it."""
    save_file(timm_sd(3), str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    new, rows = load(params, tmp_path / "m.safetensors", spec)
    head = [r for r in rows if r.param.startswith("head/")]
    assert [r.action for r in head] == ["loaded", "loaded"] and np.any(new["head"]["kernel"])
    assert head[0].note == (f"same shape ({D}, {NCLS}) as the model's: kept (config.init_reset_head="
                            "True zeroes it for other classes)")
    new, rows = load(params, tmp_path / "m.safetensors", spec, reset_head=True)
    head = [r for r in rows if r.param.startswith("head/")]
    assert [r.action for r in head] == ["reinit", "reinit"] and not np.any(new["head"]["kernel"])
    assert head[0].note == "zeros: config.init_reset_head=True"
    sd = timm_sd(3)
    sd["head.weight"], sd["head.bias"] = sd["head.weight"][:3], sd["head.bias"][:3]
    save_file(sd, str(tmp_path / "h3.safetensors"))
    _, rows = load(params, tmp_path / "h3.safetensors", spec)
    head = [r for r in rows if r.param.startswith("head/")]
    assert head[0].note == f"zeros: head ({D}, 3) -> ({D}, {NCLS}) (class count or width)"


def test_file_without_qkv_bias_names_the_config_key(tmp_path):
    """timm's qkv_bias=False (DTN's, T2T's files) was refused with 'missing in checkpoint:
    .../key/bias' only; the first error now names model.qkv_bias=False."""
    sd = {k: v for k, v in timm_sd(3).items() if not k.endswith("attn.qkv.bias")}
    path = tmp_path / "m.safetensors"
    save_file(sd, str(path))
    spec, _, params, _ = build()
    with pytest.raises(pretrained.CheckpointError,
                       match=rf"^cannot load init_from {re.escape(str(path))}: the checkpoint has no "
                             r"query/key/value biases: set model\.qkv_bias=False; missing in "
                             r"checkpoint: Transformer/encoderblock_0\.\.1/"):
        load(params, path, spec)
    _, _, params, _ = build(qkv_bias=False)
    spec = models.spec_of(dict(name="vit", patch_size=P, hidden_size=D, depth=DEPTH, num_heads=H,
                               mlp_dim=MLP, gelu_approximate=False, qkv_bias=False), NCLS)
    _, rows = load(params, path, spec)
    assert {r.action for r in rows} == {"loaded"}


def test_whole_pickled_model_pth_says_how_to_save_its_state_dict(tmp_path):
    """torch.save(model) was told `torch.save(ckpt['model'], ...)`, which fails on a module: the
    advice for a pickled nn.Module is its state_dict()."""
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(2, 2), str(tmp_path / "whole.pth"))
    spec, _, params, _ = build()
    with pytest.raises(pretrained.CheckpointError) as e:
        load(params, tmp_path / "whole.pth", spec)
    msg = str(e.value)
    assert "(torch.nn.modules.linear.Linear)" in msg and "\n" not in msg
    assert msg.endswith("a whole pickled model (torch.save(model)): save its weights alone: "
                        f"torch.save(torch.load('{tmp_path / 'whole.pth'}', weights_only=False)"
                        ".state_dict(), 'FILE.pth')")
    assert "ckpt['model']" not in msg


def test_config_init_reset_head_reaches_the_loader(tmp_path):
    """config.init_reset_head (default False, documented in configs/default.py) zeroes a head
    that fits, through the loop's loader (train/build.init_from_pretrained)."""
    from flax import traverse_util

    from configs import default
    from normvit_jax import sharding
    from normvit_jax.train import build as build_lib
    from normvit_jax.train import optimizer, setup
    from tests.conftest import tiny_demo_config

    assert default.get_config().init_reset_head is False
    save_file(timm_sd(3, grid=2), str(tmp_path / "m.safetensors"))
    cfg = tiny_demo_config(**{"model.hidden_size": D, "model.mlp_dim": MLP, "model.patch_size": P,
                              "model.depth": DEPTH, "model.num_heads": H,
                              "init_from": str(tmp_path / "m.safetensors")})
    run_spec = setup.validate_config(cfg, 1)
    model = setup.create_model(cfg, NCLS, run_spec)
    tx, _ = optimizer.create(cfg, 6)
    state, shardings = setup.create_train_state(model, tx, (8, 8, 3), sharding.make_mesh(cfg),
                                                jax.random.key(0))
    for reset in (False, True):
        cfg.init_reset_head = reset
        new = build_lib.init_from_pretrained(cfg, run_spec, NCLS, state, tx, shardings)
        kernel = traverse_util.flatten_dict(new.params, sep="/")["head/kernel"]
        assert np.any(np.asarray(kernel)) != reset

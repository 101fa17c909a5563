"""init_from with state-dict files a user could plausibly hand it that are not what they seem: each
is refused in one line naming the problem (exit 2 through main.py, nothing written), or, where the
file is a readable state dict after all, loaded. Tiny random timm-layout dicts
(test_pretrained_timm's helpers). The torch-only cases skip without torch.
"""
from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from normvit_jax import preflight, pretrained, state_dict
from tests.test_pretrained_timm import D, NCLS, build, load, main_py_stopped, timm_sd


def with_dtype(path, key: str, dtype: str) -> None:
    """Rewrites a .safetensors file's header so that ``key`` is stored as ``dtype`` (same bytes per
    element: FP8 files without torch, which numpy cannot write)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[key]["dtype"] = dtype
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    open(path, "wb").write(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def refused(params, path, spec, pattern: str) -> str:
    with pytest.raises(pretrained.CheckpointError, match=pattern) as e:
        load(params, path, spec)
    return str(e.value)


def test_main_py_refuses_fp8_weights_in_one_line(tmp_path):
    """FP8 tensors (scales elsewhere): safetensors' numpy reader raised an AttributeError (exit 1,
    a traceback); now one 'Stopped:' line naming the tensor and its dtype, exit 2, no workdir."""
    sd = timm_sd(31)
    sd["blocks.0.attn.qkv.weight"] = np.zeros((3 * D, D), np.uint8) + 56  # FP8 bytes
    path = tmp_path / "fp8.safetensors"
    save_file(sd, str(path))
    with_dtype(path, "blocks.0.attn.qkv.weight", "F8_E4M3")
    r, stopped = main_py_stopped(path, tmp_path)
    assert len(stopped) == 1 and "'blocks.0.attn.qkv.weight' is F8_E4M3" in stopped[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "wd").exists()


@pytest.mark.parametrize("case", ["int8", "bool", "nan"])
def test_integer_and_non_finite_weights_are_refused(tmp_path, case):
    """int8 weights (quantized, scales elsewhere) or a bool table were cast to float and loaded
    silently, as were NaN weights (the run then stopped at step 1 with a NaN loss)."""
    sd = timm_sd(32)
    key = {"int8": "blocks.0.attn.qkv.weight", "bool": "pos_embed", "nan": "blocks.1.norm2.weight"}[case]
    sd[key] = (sd[key] > 0).astype({"int8": np.int8, "bool": bool}.get(case, np.float32))
    if case == "nan":
        sd[key][:3] = np.nan
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    want = {"int8": r"dtype: .*encoderblock_0/MultiHeadDotProductAttention_1/query/kernel is int8, "
                    r"the model's float32 \(quantized weights, or not a weight\)",
            "bool": r"dtype: Transformer/posembed_input/pos_embedding is bool",
            "nan": r"not finite: Transformer/encoderblock_1/LayerNorm_2/scale holds 3 NaN and 0 Inf"}
    first = refused(params, tmp_path / "m.safetensors", spec, want[case]).splitlines()[0]
    assert re.search(want[case], first)


def test_prefixes_a_user_gets_wrong_are_named(tmp_path):
    """A 'module.' prefix on some keys only (two dicts merged) was a misleading 'not a square grid /
    no class token' error; an EMA copy saved under its prefix named no prefix."""
    sd = timm_sd(33)
    spec, _, params, _ = build()
    half = {("module." + k if k.startswith("blocks.") else k): v for k, v in sd.items()}
    save_file(half, str(tmp_path / "ddp.safetensors"))
    msg = refused(params, tmp_path / "ddp.safetensors", spec,
                  r"24 of 32 keys have the 'module\.' prefix \(DistributedDataParallel; e\.g\. "
                  r"module\.blocks\.0\.attn\.proj\.bias\), the others not \(e\.g\. cls_token\)")
    assert "\n" not in msg
    save_file({"model_ema." + k: v for k, v in sd.items()}, str(tmp_path / "ema.safetensors"))
    msg = refused(params, tmp_path / "ema.safetensors", spec,
                  r"its ViT keys are under 'model_ema\.' \(an EMA copy or a wrapper's prefix\)")
    assert "\n" not in msg


def test_files_named_as_another_format(tmp_path, monkeypatch):
    """A .bin holding a safetensors file (a renamed download) loads without torch, as the same
    file named .safetensors; an empty one, a '~' path and an .npz that is a safetensors file are
    named in one line (they read as 'needs torch', 'does not exist', 'not a zip')."""
    monkeypatch.setattr(state_dict, "_has_torch", lambda: False)
    sd = timm_sd(34)
    save_file(sd, str(tmp_path / "m.safetensors"))
    (tmp_path / "m.bin").write_bytes((tmp_path / "m.safetensors").read_bytes())
    spec, _, params, _ = build()
    lines = []
    got, rows = pretrained.init_from_npz(params, str(tmp_path / "m.bin"), spec, NCLS, log=lines.append)
    want, _ = load(params, tmp_path / "m.safetensors", spec)
    assert {r.action for r in rows} == {"loaded"}
    assert "layout: timm VisionTransformer state dict: " in lines[0]
    for a, b in zip(jax_leaves(got), jax_leaves(want)):
        np.testing.assert_array_equal(a, b)
    save_file(sd, str(tmp_path / "meta.safetensors"), metadata={"format": "pt", "note": "ok"})
    assert state_dict.read(str(tmp_path / "meta.safetensors"))[0].keys() == sd.keys()
    save_file(sd, str(tmp_path / "flax.safetensors"), metadata={"format": "flax"})
    refused(params, tmp_path / "flax.safetensors", spec, r"saved from flax \(metadata format='flax'\)")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"'.*empty\.bin' is an empty file"):
        state_dict.check(str(tmp_path / "empty.bin"))
    with pytest.raises(ValueError, match=r"does not exist \(a '~' is not expanded here"):
        state_dict.check("~/no_such_normvit_file.safetensors")
    save_file({"embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
               "cls": sd["cls_token"]}, str(tmp_path / "google.safetensors"))
    refused(params, tmp_path / "google.safetensors", spec,
            r"its keys are Google's ViT names \(embedding/kernel\): save them as an \.npz")
    (tmp_path / "m.npz").write_bytes((tmp_path / "m.safetensors").read_bytes())
    refused(params, tmp_path / "m.npz", spec, r"a \.safetensors file \(a PyTorch state dict\), not "
                                              r"an \.npz archive: name it FILE\.safetensors")


@pytest.mark.parametrize("extra, message", [
    ({"blocks.0.norm1.alpha": (2,), "blocks.0.norm1.bn.weight": (D,)},
     r"blocks\.0\.norm1\.alpha \(2,\): SLAB RepBN's alpha is one finite number, the file holds 2 values"),
    ({"blocks.1.norm2.norm1.weight": (D,), "blocks.1.norm2.iter": (0,), "blocks.1.norm2.total_step": (1,)},
     r"blocks\.1\.norm2\.iter \(0,\): SLAB LinearNorm's iter is one finite number"),
], ids=["repbn_alpha", "linearnorm_iter"])
def test_malformed_original_norm_tensors_are_named(tmp_path, extra, message):
    """An original norm's scalar of another size was a bare 'cannot reshape array' ValueError (or,
    for SLAB LinearNorm's empty step counter, an IndexError traceback)."""
    sd = timm_sd(36)
    sd.update({k: np.ones(s, np.float32) for k, s in extra.items()})
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    assert "\n" not in refused(params, tmp_path / "m.safetensors", spec, "^cannot load init_from .*" + message)


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------------------------ torch only

def test_torch_files_that_are_not_plain_float_tensors(tmp_path, monkeypatch):
    """gs:// .pth (torch.load was given the URL: 'no such file'); FP8 and quantized tensors
    (widened or a TypeError traceback) refused; a sparse tensor loads densified; an EMA-only
    training checkpoint says how to start from it; an .npz named .pth says so."""
    torch = pytest.importorskip("torch")
    sd = {k: torch.from_numpy(v) for k, v in timm_sd(35).items()}
    spec, _, params, _ = build()
    torch.save(sd, str(tmp_path / "ok.pth"))
    real_path = state_dict.epath.Path
    monkeypatch.setattr(state_dict.epath, "Path", lambda p: real_path(
        str(tmp_path / "ok.pth") if str(p).startswith("gs://") else p))
    got, _ = state_dict.read("gs://bucket/ok.pth")
    for k, v in sd.items():
        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)
    monkeypatch.setattr(state_dict.epath, "Path", real_path)
    fp8 = dict(sd, **{"blocks.0.attn.qkv.weight": sd["blocks.0.attn.qkv.weight"].to(torch.float8_e4m3fn)})
    quant = dict(sd, **{"head.weight": torch.quantize_per_tensor(sd["head.weight"], 0.1, 0, torch.qint8)})
    sparse = dict(sd, **{"head.bias": sd["head.bias"].to_sparse()})
    for name, d in (("fp8", fp8), ("quant", quant), ("sparse", sparse)):
        torch.save(d, str(tmp_path / f"{name}.pth"))
    refused(params, tmp_path / "fp8.pth", spec, r"'blocks\.0\.attn\.qkv\.weight' is float8_e4m3fn \(FP8")
    refused(params, tmp_path / "quant.pth", spec, r"'head\.weight' is qint8 \(FP8 or quantized")
    got, _ = state_dict.read(str(tmp_path / "sparse.pth"))
    np.testing.assert_array_equal(got["head.bias"], sd["head.bias"].numpy())
    torch.save({"model_ema": sd, "epoch": 3}, str(tmp_path / "ema.pth"))
    refused(params, tmp_path / "ema.pth", spec, r"an EMA copy \(model_ema\) is never taken silently: "
                                                 r"to start from it, save it alone")
    np.savez(str(tmp_path / "arrays.npz"), a=np.ones(3))
    os.replace(tmp_path / "arrays.npz", tmp_path / "arrays.pth")
    refused(params, tmp_path / "arrays.pth", spec, r"an \.npz archive \(numpy arrays\), not a PyTorch file")


def test_a_non_square_grid_loads_through_the_config(tmp_path):
    """A 2x3 pos_embed grid (+ class slot): without a grid the error named only the Python keyword
    (source_grid=), which main.py could not pass; config.init_source_grid='2x3' now reaches the
    loader (the loop's path). Corner-aligned 2x3 -> 2x2 keeps columns 0 and 2 exactly."""
    from flax import traverse_util

    from normvit_jax import sharding
    from normvit_jax.models import google_layout
    from normvit_jax.train import build as build_lib
    from normvit_jax.train import optimizer, setup
    from tests.conftest import tiny_demo_config

    sd = timm_sd(37)
    sd["pos_embed"] = np.random.default_rng(38).normal(size=(1, 7, D)).astype(np.float32)
    save_file(sd, str(tmp_path / "m.safetensors"))
    spec, _, params, _ = build()
    # 7 positions = the class slot + 6 patches (was '7 patch positions', 'no class slot')
    msg = refused(params, tmp_path / "m.safetensors", spec,
                  r"checkpoint pos_embed \(1, 7, 8\) = 1 class slot \+ 6 patch positions: 6 are not "
                  r"a square grid; pass the grid: --config\.init_source_grid=ROWSxCOLS")
    assert "7 patch positions" not in msg
    with pytest.raises(ValueError, match=r"init_source_grid='2,3' is not a grid ROWSxCOLS"):
        google_layout.parse_grid("2,3")
    cfg = tiny_demo_config(**{"model.hidden_size": D, "model.mlp_dim": 16, "model.patch_size": 4})
    cfg.init_from, cfg.init_source_grid = str(tmp_path / "m.safetensors"), "2,3"
    with pytest.raises(ValueError, match=r"^config\.init_source_grid='2,3' is not a grid"):
        preflight.check(cfg, str(tmp_path / "wd"))  # before anything is written
    assert not (tmp_path / "wd").exists()
    cfg.init_source_grid = "2x3"
    run_spec = setup.validate_config(cfg, 1)
    model = setup.create_model(cfg, 10, run_spec)
    tx, _ = optimizer.create(cfg, 6)
    state, shardings = setup.create_train_state(model, tx, (8, 8, 3), sharding.make_mesh(cfg),
                                                jax.random.key(0))
    new = build_lib.init_from_pretrained(cfg, run_spec, 10, state, tx, shardings)
    pe = traverse_util.flatten_dict(new.params, sep="/")["Transformer/posembed_input/pos_embedding"]
    grid = sd["pos_embed"][0, 1:].reshape(2, 3, D)
    np.testing.assert_allclose(np.asarray(pe)[0, 1:], grid[:, [0, 2]].reshape(4, D), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pe)[0, 0], sd["pos_embed"][0, 0])


def test_report_and_errors_fold_blocks_without_covering_gaps(tmp_path):
    """A block with another norm (norm_overrides.block_2) was covered by the others' range
    ('encoderblock_0..3/LayerNorm_0/bias loaded' while block 2's was dropped); errors of a
    wrong width were one line per block (a ViT-B: 192, 40 shown)."""
    import jax.numpy as jnp

    from normvit_jax import models
    save_file(timm_sd(39, depth=4), str(tmp_path / "m.safetensors"))

    def model(width=D, **kw):
        spec = models.spec_of(dict(name="vit", patch_size=4, hidden_size=width, depth=4,
                                   num_heads=2, mlp_dim=16, **kw), NCLS)
        return spec, models.create(spec).init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)))["params"]
    spec, params = model(norm_overrides={"block_2": "rmsnorm"})
    lines = []
    pretrained.init_from_npz(params, str(tmp_path / "m.safetensors"), spec, NCLS, log=lines.append)
    table = lines[0]
    assert re.search(r"encoderblock_0\.\.1,3/LayerNorm_0/bias +\(8,\) +loaded", table), table
    assert re.search(r"encoderblock_2/LayerNorm_0/bias +\(8,\) +dropped +rmsnorm has no 'bias'", table)
    assert "encoderblock_0..3/LayerNorm" not in table
    spec, params = model(width=12)
    msg = refused(params, tmp_path / "m.safetensors", spec, r"differs from the checkpoint in width")
    assert ("shape mismatch: Transformer/encoderblock_0..3/LayerNorm_0/scale checkpoint (8,) vs "
            "model (12,)") in msg
    assert "encoderblock_1/" not in msg and len(msg.splitlines()) < 30  # unfolded: 45

"""Google ViT .npz import/export on tiny fake checkpoints written here (depth 2, width 8, 2 heads,
patch 4, 16 px): vit_jax, AugReg and big_vision layouts (per-block and scanned, bfloat16 as |V2).

References are independent: a float64 numpy ViT reading the raw .npz arrays in their own layout,
posemb resizing by separable np.interp with corner-aligned positions (= scipy.ndimage.zoom order=1,
which vit_jax/big_vision use). Tolerances: float32 model vs float64 reference, rtol=atol=1e-4.
"""
from __future__ import annotations

import math
import os
import re
import sys
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from flax.core import frozen_dict

from normvit_jax import export, models, norms, pretrained
from normvit_jax.models import google_layout
from normvit_jax.norms import registry

D, H, DH, MLP, P, DEPTH = 8, 2, 4, 16, 4, 2
SENTINEL = -7.25  # every template leaf starts here, so "left at init" is checkable exactly
OLD = dict(ln0="LayerNorm_0", mha="MultiHeadDotProductAttention_1", ln1="LayerNorm_2", mlp="MlpBlock_3")
NEW = dict(ln0="LayerNorm_0", mha="MultiHeadDotProductAttention_0", ln1="LayerNorm_1", mlp="MlpBlock_0")


# ------------------------------------------------------------------------------- fake checkpoints

def logical(seed: int, *, ncls: int = 5, rep: int | None = None, token: bool = True,
            slot: bool = True, grid: int = 4) -> dict[str, Any]:
    """Random weights of a tiny ViT, by role (not by any file's names)."""
    r = np.random.default_rng(seed)
    n = lambda *s, sd=0.5: (r.normal(size=s) * sd).astype(np.float32)
    w = dict(patch_k=n(P, P, 3, D, sd=0.3), patch_b=n(D), enc_s=1 + n(D, sd=0.2), enc_b=n(D),
             posemb=n(1, grid * grid + int(token and slot), D), head_k=n(rep or D, ncls),
             head_b=n(ncls), blocks=[])
    if token:
        w["cls"] = n(1, 1, D)
    if rep:
        w["pre_k"], w["pre_b"] = n(D, rep), n(rep)
    for _ in range(DEPTH):
        w["blocks"].append(dict(
            ln0_s=1 + n(D, sd=0.2), ln0_b=n(D), ln1_s=1 + n(D, sd=0.2), ln1_b=n(D),
            q_k=n(D, H, DH), q_b=n(H, DH), k_k=n(D, H, DH), k_b=n(H, DH), v_k=n(D, H, DH),
            v_b=n(H, DH), o_k=n(H, DH, D), o_b=n(D), d0_k=n(D, MLP), d0_b=n(MLP), d1_k=n(MLP, D),
            d1_b=n(D)))
    return w


def block_entries(b: dict, names: dict) -> dict[str, np.ndarray]:
    m, mlp = names["mha"], names["mlp"]
    return {f"{names['ln0']}/scale": b["ln0_s"], f"{names['ln0']}/bias": b["ln0_b"],
            f"{names['ln1']}/scale": b["ln1_s"], f"{names['ln1']}/bias": b["ln1_b"],
            **{f"{m}/{t}/kernel": b[f"{t[0]}_k"] for t in ("query", "key", "value", "out")},
            **{f"{m}/{t}/bias": b[f"{t[0]}_b"] for t in ("query", "key", "value", "out")},
            f"{mlp}/Dense_0/kernel": b["d0_k"], f"{mlp}/Dense_0/bias": b["d0_b"],
            f"{mlp}/Dense_1/kernel": b["d1_k"], f"{mlp}/Dense_1/bias": b["d1_b"]}


def vit_jax_file(w: dict) -> dict[str, np.ndarray]:
    """vit_jax / AugReg: pre-linen numbering, posemb (with the class slot) under Transformer."""
    f = {"embedding/kernel": w["patch_k"], "embedding/bias": w["patch_b"],
         "Transformer/posembed_input/pos_embedding": w["posemb"],
         "Transformer/encoder_norm/scale": w["enc_s"], "Transformer/encoder_norm/bias": w["enc_b"],
         "head/kernel": w["head_k"], "head/bias": w["head_b"]}
    if "cls" in w:
        f["cls"] = w["cls"]
    if "pre_k" in w:
        f["pre_logits/kernel"], f["pre_logits/bias"] = w["pre_k"], w["pre_b"]
    for i, b in enumerate(w["blocks"]):
        f.update({f"Transformer/encoderblock_{i}/{k}": v for k, v in block_entries(b, OLD).items()})
    return f


def to_bf16_void(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).view(np.uint16).view("V2")


def big_vision_file(w: dict, *, scanned: bool, bf16: bool) -> dict[str, np.ndarray]:
    """big_vision: 'params/' prefix, top-level posemb without class slot, _0/_0/_1/_0 numbering."""
    f = {"embedding/kernel": w["patch_k"], "embedding/bias": w["patch_b"], "cls": w["cls"],
         "pos_embedding": w["posemb"], "Transformer/encoder_norm/scale": w["enc_s"],
         "Transformer/encoder_norm/bias": w["enc_b"], "head/kernel": w["head_k"], "head/bias": w["head_b"]}
    per = [block_entries(b, NEW) for b in w["blocks"]]
    if scanned:
        f.update({f"Transformer/encoderblock/{k}": np.stack([p[k] for p in per]) for k in per[0]})
    else:
        for i, p in enumerate(per):
            f.update({f"Transformer/encoderblock_{i}/{k}": v for k, v in p.items()})
    if bf16:
        f = {k: to_bf16_void(v) for k, v in f.items()}
    out = {f"params/{k}": v for k, v in f.items()}
    out["opt/state/count"] = np.array(3, np.int32)  # optimizer state beside the params: ignored
    return out


def write(path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)
    return str(path)


# ------------------------------------------------------------------------ independent references

def resize_ref(g: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Separable bilinear with corner-aligned sample positions, float64."""
    g = np.asarray(g, np.float64)
    rows = np.linspace(0, g.shape[0] - 1, hw[0])
    g = np.stack([[np.interp(rows, np.arange(g.shape[0]), g[:, j, d]) for d in range(g.shape[2])]
                  for j in range(g.shape[1])]).transpose(2, 0, 1)
    cols = np.linspace(0, g.shape[1] - 1, hw[1])
    return np.stack([[np.interp(cols, np.arange(g.shape[1]), g[i, :, d]) for d in range(g.shape[2])]
                     for i in range(g.shape[0])]).transpose(0, 2, 1)


def as64(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "V":
        return a.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


def np_vit(raw: dict, images: np.ndarray, *, layout: str, rep: bool = True) -> np.ndarray:
    """float64 ViT (pre-LN, tanh GELU, token pooling) on the raw arrays of a vit_jax or big_vision file."""
    if layout == "vit_jax":
        g = lambda k: as64(raw[k])
        blk = lambda i, m, p: g(f"Transformer/encoderblock_{i}/{OLD[m]}/{p}")
    else:
        g = lambda k: as64(raw["params/" + k])
        scanned = "params/Transformer/encoderblock/LayerNorm_0/scale" in raw
        blk = (lambda i, m, p: g(f"Transformer/encoderblock/{NEW[m]}/{p}")[i]) if scanned else \
            (lambda i, m, p: g(f"Transformer/encoderblock_{i}/{NEW[m]}/{p}"))

    def ln(x, s, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * s + b

    b_, h, w_, _ = images.shape
    gh, gw = h // P, w_ // P
    x = np.einsum("bhuwvc,uvcd->bhwd", images.astype(np.float64).reshape(b_, gh, P, gw, P, 3),
                  g("embedding/kernel")).reshape(b_, gh * gw, D) + g("embedding/bias")
    cls = np.broadcast_to(g("cls"), (b_, 1, D))
    if layout == "vit_jax":  # class token first, then posemb with its class slot
        pe = g("Transformer/posembed_input/pos_embedding")
        s = math.isqrt(pe.shape[1] - 1)
        grid = resize_ref(pe[0, 1:].reshape(s, s, D), (gh, gw)).reshape(1, gh * gw, D)
        x = np.concatenate([cls, x], 1) + np.concatenate([pe[:, :1], grid], 1)
    else:  # big_vision: posemb on patches only, class token after
        pe = g("pos_embedding")
        s = math.isqrt(pe.shape[1])
        x = np.concatenate([cls, x + resize_ref(pe[0].reshape(s, s, D), (gh, gw)).reshape(1, -1, D)], 1)
    depth = len({re.search(r"encoderblock_(\d+)/", k).group(1) for k in raw if "encoderblock_" in k}) \
        or raw["params/Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
    for i in range(depth):
        y = ln(x, blk(i, "ln0", "scale"), blk(i, "ln0", "bias"))
        q, k, v = (np.einsum("btd,dhk->bthk", y, blk(i, "mha", f"{n}/kernel")) + blk(i, "mha", f"{n}/bias")
                   for n in ("query", "key", "value"))
        a = np.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(DH)
        a = np.exp(a - a.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("bhqt,bthk->bqhk", a, v)
        x = x + np.einsum("bqhk,hkd->bqd", o, blk(i, "mha", "out/kernel")) + blk(i, "mha", "out/bias")
        y = ln(x, blk(i, "ln1", "scale"), blk(i, "ln1", "bias"))
        y = y @ blk(i, "mlp", "Dense_0/kernel") + blk(i, "mlp", "Dense_0/bias")
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
        x = x + y @ blk(i, "mlp", "Dense_1/kernel") + blk(i, "mlp", "Dense_1/bias")
    x = ln(x, g("Transformer/encoder_norm/scale"), g("Transformer/encoder_norm/bias"))[:, 0]
    if rep and any(k.endswith("pre_logits/kernel") for k in raw):
        x = np.tanh(x @ g("pre_logits/kernel") + g("pre_logits/bias"))
    return x @ g("head/kernel") + g("head/bias")


# ------------------------------------------------------------------------------------------ helpers

def model_cfg(**kw) -> dict:
    return {**dict(hidden_size=D, depth=DEPTH, num_heads=H, mlp_dim=MLP, patch_size=P), **kw}


def template(cfg: dict, ncls: int, hw: tuple[int, int] = (16, 16)) -> dict:
    """The model's parameter tree at `SENTINEL` (shapes from jax.eval_shape, nothing computed)."""
    m = models.create(cfg, ncls)
    shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, *hw, 3), jnp.float32))
    return jax.tree.map(lambda s: np.full(s.shape, SENTINEL, s.dtype), shapes["params"])


def flat(tree: Any) -> dict[str, np.ndarray]:
    return traverse_util.flatten_dict(frozen_dict.unfreeze(tree), sep="/")


def logits(cfg: dict, ncls: int, params: dict, images: np.ndarray) -> np.ndarray:
    m = models.create(cfg, ncls)
    return np.asarray(jax.jit(m.apply)({"params": params}, images))


def images(hw: tuple[int, int], n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, *hw, 3)).astype(np.float32)


def load(params, path, cfg, ncls, **kw):
    lines: list[str] = []
    new, rows = pretrained.init_from_npz(params, path, cfg, ncls, log=lines.append, **kw)
    # dropped rows are checkpoint keys: filed under 'ckpt:' so they never hide a model row
    return new, {("ckpt:" if r.action == "dropped" else "") + r.param: r for r in rows}, "\n".join(lines)


# ---------------------------------------------------------------------------------------- layouts

@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
@pytest.mark.parametrize("px", [16, 32])
def test_vit_jax_layout_values_and_logits(tmp_path, px):
    w = logical(0, rep=6)
    raw = vit_jax_file(w)
    path = write(tmp_path / "ViT-B_16.npz", raw)
    cfg = model_cfg(representation_size=6)
    new, rows, table = load(template(cfg, 5, (px, px)), path, cfg, 5, image_size=px)
    f = flat(new)
    # spot entries by index, not only shapes
    b1 = "Transformer/encoderblock_1/"
    assert f[b1 + "MultiHeadDotProductAttention_1/query/kernel"][5, 1, 3] == w["blocks"][1]["q_k"][5, 1, 3]
    assert f[b1 + "MultiHeadDotProductAttention_1/value/bias"][1, 2] == w["blocks"][1]["v_b"][1, 2]
    assert f[b1 + "MultiHeadDotProductAttention_1/out/kernel"][0, 3, 6] == w["blocks"][1]["o_k"][0, 3, 6]
    assert f[b1 + "MlpBlock_3/Dense_1/kernel"][11, 2] == w["blocks"][1]["d1_k"][11, 2]
    assert f[b1 + "LayerNorm_2/scale"][4] == w["blocks"][1]["ln1_s"][4]
    assert f["embedding/kernel"][3, 0, 2, 7] == w["patch_k"][3, 0, 2, 7]
    assert f["pre_logits/kernel"][2, 5] == w["pre_k"][2, 5]
    np.testing.assert_array_equal(f["head/kernel"], w["head_k"])
    pe = f["Transformer/posembed_input/pos_embedding"]
    g = px // P
    assert pe.shape == (1, 1 + g * g, D)
    np.testing.assert_array_equal(pe[0, 0], w["posemb"][0, 0])  # class slot kept
    want = resize_ref(w["posemb"][0, 1:].reshape(4, 4, D), (g, g)).reshape(-1, D)
    np.testing.assert_allclose(pe[0, 1:], want, rtol=1e-6, atol=1e-6)
    assert rows["Transformer/posembed_input/pos_embedding"].action == ("loaded" if px == 16 else "resampled")
    assert {r.action for r in rows.values()} <= {"loaded", "resampled"}
    assert "vit_jax" in table and "class slot kept" in table
    x = images((px, px))
    np.testing.assert_allclose(logits(cfg, 5, new, x), np_vit(raw, x, layout="vit_jax"), rtol=1e-4, atol=1e-4)


def test_augreg_layout_new_class_count(tmp_path):
    w = logical(1, ncls=21)  # AugReg i21k: vit_jax names, no pre_logits
    path = write(tmp_path / "B_16-i21k-300ep.npz", vit_jax_file(w))
    cfg = model_cfg()
    new, rows, table = load(template(cfg, 10, (32, 32)), path, cfg, 10, image_size=32)
    f = flat(new)
    assert np.all(f["head/kernel"] == 0) and np.all(f["head/bias"] == 0)
    assert rows["head/kernel"].action == rows["head/bias"].action == "reinit"
    assert "reinit" in table and "(8, 21) -> (8, 10)" in table
    np.testing.assert_array_equal(f["cls"], w["cls"])
    np.testing.assert_array_equal(f["Transformer/encoder_norm/bias"], w["enc_b"])
    assert all(r.action in ("loaded", "resampled") for k, r in rows.items() if not k.startswith("head"))


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
@pytest.mark.parametrize("scanned,bf16", [(True, True), (False, False)])
def test_big_vision_layout(tmp_path, scanned, bf16):
    w = logical(2, slot=False)
    raw = big_vision_file(w, scanned=scanned, bf16=bf16)
    path = write(tmp_path / "bv.npz", raw)
    cfg = model_cfg()
    exp = (lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)) if bf16 else (lambda a: a)
    for px in (16, 32):
        new, rows, table = load(template(cfg, 5, (px, px)), path, cfg, 5, image_size=px)
        f = flat(new)
        b1 = "Transformer/encoderblock_1/"
        key = f[b1 + "MultiHeadDotProductAttention_1/key/kernel"]
        assert key[6, 0, 1] == exp(w["blocks"][1]["k_k"])[6, 0, 1]
        assert f[b1 + "LayerNorm_2/bias"][3] == exp(w["blocks"][1]["ln1_b"])[3]  # LayerNorm_1 -> _2
        assert f[b1 + "MlpBlock_3/Dense_0/bias"][9] == exp(w["blocks"][1]["d0_b"])[9]  # MlpBlock_0 -> _3
        assert f["Transformer/encoderblock_0/LayerNorm_0/scale"][2] == exp(w["blocks"][0]["ln0_s"])[2]
        pe = f["Transformer/posembed_input/pos_embedding"]
        np.testing.assert_array_equal(pe[0, 0], 0)  # big_vision adds no posemb to the class token
        if px == 16:
            np.testing.assert_array_equal(pe[0, 1:], exp(w["posemb"])[0])
        assert ("scanned" in table) == scanned and ("bfloat16" in table) == bf16
        assert "ignored 1 non-parameter keys" in table
        x = images((px, px), seed=px)
        np.testing.assert_allclose(logits(cfg, 5, new, x), np_vit(raw, x, layout="big_vision"),
                                   rtol=1e-4, atol=1e-4)


def test_prefix_and_numbering_variants_load_the_same(tmp_path):
    """'opt/target/' prefix (old full checkpoints) and linen numbering with vit_jax's posembed_input."""
    w = logical(14)
    base = vit_jax_file(w)
    linen = {}
    for k, v in base.items():
        parts = k.split("/")
        if k.startswith("Transformer/encoderblock_"):
            parts[2] = {OLD[m]: NEW[m] for m in OLD}[parts[2]]
        linen["opt/target/" + "/".join(parts)] = v
    cfg = model_cfg()
    ref, _, _ = load(template(cfg, 5), write(tmp_path / "a.npz", base), cfg, 5)
    new, _, table = load(template(cfg, 5), write(tmp_path / "b.npz", linen), cfg, 5)
    assert "prefix=opt/target/" in table and "numbering=linen" in table and "with class slot" in table
    for k, v in flat(ref).items():
        np.testing.assert_array_equal(flat(new)[k], v, err_msg=k)


def test_flattened_head_kernels_reshape(tmp_path):
    w = logical(3)
    raw = vit_jax_file(w)
    for k in list(raw):
        if "MultiHeadDotProductAttention_1" in k:
            a = raw[k]
            raw[k] = a.reshape(H * DH, D) if "/out/kernel" in k else (
                a.reshape(D) if "/out/" in k else a.reshape(a.shape[0], -1) if a.ndim == 3 else a.reshape(-1))
    path = write(tmp_path / "flat.npz", raw)
    cfg = model_cfg()
    new, rows, _ = load(template(cfg, 5), path, cfg, 5)
    f = flat(new)
    for i, b in enumerate(w["blocks"]):
        for t in ("query", "key", "value", "out"):
            k = f"Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{t}/kernel"
            np.testing.assert_array_equal(f[k], b[f"{t[0]}_k"])
            np.testing.assert_array_equal(f[k.replace("kernel", "bias")], b[f"{t[0]}_b"])
    assert "reshaped (8, 8) -> (8, 2, 4)" in rows[
        "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"].note
    # another mismatch (depth): the first line names it, not heads: (D, H*Dh) kernels give no head
    # count (it said 'heads (checkpoint 8, model 2)', H*Dh taken for H)
    deep = model_cfg(depth=3)
    with pytest.raises(pretrained.CheckpointError) as err:
        load(template(deep, 5), path, deep, 5)
    first = str(err.value).splitlines()[0]
    assert "differs from the checkpoint in depth (checkpoint 2, model 3);" in first
    assert "heads" not in first and "checkpoint: depth=2 width=8 heads=? " in str(err.value)


def test_pre_logits_dropped_or_kept_by_config(tmp_path):
    path = write(tmp_path / "rep.npz", vit_jax_file(logical(4, rep=6)))
    cfg = model_cfg()  # no representation_size: pre_logits dropped, head reset (its input changed)
    new, rows, table = load(template(cfg, 5), path, cfg, 5)
    assert rows["ckpt:pre_logits/kernel"].action == "dropped" and rows["head/kernel"].action == "reinit"
    assert "head input changed" in rows["head/kernel"].note
    cfg6 = model_cfg(representation_size=6)
    new, rows, _ = load(template(cfg6, 5), path, cfg6, 5, keep_pre_logits=False)
    assert rows["pre_logits/kernel"].action == "init" and np.all(flat(new)["pre_logits/kernel"] == SENTINEL)
    with pytest.raises(pretrained.CheckpointError,
                       match="^init_keep_pre_logits=True .*set model.representation_size=6"):
        load(template(cfg, 5), path, cfg, 5, keep_pre_logits=True)
    # a model with a new pre_logits layer (at init) and a file without one: the file's head saw the
    # encoder's features, not that layer's, so it is zeroed even where its shape fits (it loaded)
    plain = write(tmp_path / "plain.npz", vit_jax_file(logical(4)))
    cfg8 = model_cfg(representation_size=D)
    new, rows, _ = load(template(cfg8, 5), plain, cfg8, 5)
    assert rows["pre_logits/kernel"].action == "init" and rows["head/kernel"].action == "reinit"
    assert "head input changed" in rows["head/kernel"].note
    assert np.all(flat(new)["head/kernel"] == 0) and np.all(flat(new)["head/bias"] == 0)


def test_class_token_variants(tmp_path):
    w = logical(5)
    path = write(tmp_path / "tok.npz", vit_jax_file(w))
    gap = model_cfg(classifier="gap")  # gap model: no class slot, the checkpoint's cls is dropped
    new, rows, _ = load(template(gap, 5), path, gap, 5)
    np.testing.assert_array_equal(flat(new)["Transformer/posembed_input/pos_embedding"], w["posemb"][:, 1:])
    assert rows["ckpt:cls"].action == "dropped"
    late = model_cfg(cls_token_at_block=1)  # class token joins late, without posemb: slot folded in
    new, rows, _ = load(template(late, 5), path, late, 5)
    np.testing.assert_array_equal(flat(new)["cls"], w["cls"] + w["posemb"][:, :1])
    assert flat(new)["Transformer/posembed_input/pos_embedding"].shape == (1, 16, D)


def test_non_square_grid(tmp_path):
    w = logical(6)
    path = write(tmp_path / "sq.npz", vit_jax_file(w))
    cfg = model_cfg()
    new, rows, _ = load(template(cfg, 5, (16, 32)), path, cfg, 5, image_size=(16, 32))
    pe = flat(new)["Transformer/posembed_input/pos_embedding"]
    np.testing.assert_array_equal(pe[0, 0], w["posemb"][0, 0])
    want = resize_ref(w["posemb"][0, 1:].reshape(4, 4, D), (4, 8)).reshape(-1, D)
    np.testing.assert_allclose(pe[0, 1:], want, rtol=1e-6, atol=1e-6)
    assert "4x4 -> 4x8" in rows["Transformer/posembed_input/pos_embedding"].note


def test_resample_grid_matches_references():
    g = np.random.default_rng(7).normal(size=(3, 5, 4)).astype(np.float32)
    for hw in [(6, 4), (3, 5), (1, 7), (9, 9)]:
        np.testing.assert_allclose(pretrained.resample_grid(g, hw), resize_ref(g, hw), rtol=1e-6, atol=1e-6)
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    np.testing.assert_allclose(pretrained.resample_grid(g, (6, 4)),
                               scipy_ndimage.zoom(g.astype(np.float64), (2, 0.8, 1), order=1),
                               rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------ other norms

class AffineTestNorm(nn.Module):
    """Test-only norm: LN-like 'scale'/'bias' plus a parameter LN has no counterpart for."""

    @nn.compact
    def __call__(self, x, train=False):
        c = x.shape[-1]
        mix = self.param("mix", nn.initializers.ones, (c,))
        return x * self.param("scale", nn.initializers.ones, (c,)) * mix + self.param(
            "bias", nn.initializers.zeros, (c,))


class ScalarScaleNorm(nn.Module):
    """Test-only norm whose 'scale' is one scalar: it must stay at init, not load LN's vector."""

    @nn.compact
    def __call__(self, x, train=False):
        return x * self.param("scale", nn.initializers.ones, ())


@pytest.fixture
def test_norms(monkeypatch):
    monkeypatch.setitem(registry._ENTRIES, "affine_test", f"{__name__}:AffineTestNorm")
    monkeypatch.setitem(registry._ENTRIES, "scalar_test", f"{__name__}:ScalarScaleNorm")


def check_cross_norm(tmp_path, norm_name: str) -> dict:
    w = logical(8)
    raw = vit_jax_file(w)
    path = write(tmp_path / f"ln_{norm_name}.npz", raw)
    cfg = model_cfg(norm={"name": norm_name})
    params = template(cfg, 5)  # every registered norm builds a depth-2 width-8 ViT
    new, rows, _ = load(params, path, cfg, 5)
    f = flat(new)
    for k, v in f.items():
        slot = google_layout.slot_of(k)
        if slot is None:  # same layer: same tensor
            np.testing.assert_array_equal(v, raw[k], err_msg=k)
        elif slot[1] in ("scale", "bias") and v.shape == raw[k].shape:
            np.testing.assert_array_equal(v, raw[k], err_msg=k)
            assert rows[k].action == "loaded"
        else:
            assert rows[k].action == "init" and np.all(v == SENTINEL), k
    return rows


@pytest.mark.parametrize("norm_name", sorted(set(norms.known_names()) - {"layernorm"}))
def test_layernorm_checkpoint_into_registered_norms(tmp_path, norm_name):
    check_cross_norm(tmp_path, norm_name)


def test_layernorm_checkpoint_into_other_norms_by_name(tmp_path, test_norms):
    rows = check_cross_norm(tmp_path, "affine_test")
    k = "Transformer/encoderblock_0/LayerNorm_0/"
    assert rows[k + "scale"].action == "loaded" and "LN scale -> affine_test scale" in rows[k + "scale"].note
    assert rows[k + "mix"].action == "init"
    rows = check_cross_norm(tmp_path, "scalar_test")
    assert rows[k + "scale"].action == "init" and "another shape" in rows["ckpt:" + k + "scale"].note
    assert rows["ckpt:" + k + "bias"].action == "dropped"
    rows = check_cross_norm(tmp_path, "identity")
    assert rows["ckpt:" + k + "scale"].action == "dropped"


# ----------------------------------------------------------------------------------------- errors

def test_malformed_files_fail_clearly(tmp_path):
    cfg = model_cfg()
    params = template(cfg, 5)
    good = vit_jax_file(logical(9))
    path = write(tmp_path / "good.npz", good)
    E = pretrained.CheckpointError

    data = open(path, "rb").read()
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(E, match="truncated or corrupt"):
        pretrained.load_npz(str(trunc))

    key = "Transformer/encoderblock_1/MlpBlock_3/Dense_0/bias"
    missing = write(tmp_path / "missing.npz", {k: v for k, v in good.items() if k != key})
    with pytest.raises(E, match=rf"missing in checkpoint: {key} \(model \(16,\)\)"):
        load(params, missing, cfg, 5)

    key = "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"
    shaped = write(tmp_path / "shape.npz", {**good, key: good[key].T.copy()})
    with pytest.raises(E, match=rf"shape mismatch: {key} checkpoint \(16, 8\) vs model \(8, 16\)"):
        load(params, shaped, cfg, 5)

    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **good, evil=np.array([{"a": 1}], dtype=object))
    with pytest.raises(E, match="'evil' holds Python objects"):
        pretrained.load_npz(str(pickled))
    plain_pickle = tmp_path / "plain.npz"
    # Written with a pickle on purpose: the loader (allow_pickle=False) must refuse to read it.
    np.save(open(plain_pickle, "wb"), np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(E, match="pickle|single .npy"):
        pretrained.load_npz(str(plain_pickle))

    with pytest.raises(E, match="does not exist"):
        pretrained.load_npz(str(tmp_path / "nope.npz"))

    deep = model_cfg(depth=3)  # wrong depth: the first line says what differs, then both summaries
    with pytest.raises(E, match=r"(?s)^cannot load init_from \S+good.npz: the model config differs from "
                                r"the checkpoint in depth \(checkpoint 2, model 3\); missing in "
                                r"checkpoint: Transformer/encoderblock_2/[^\n]*\(and 14 more, below\)\n"
                                r".*checkpoint: depth=2.*model: +depth=3"):
        load(template(deep, 5), path, deep, 5)
    wide = model_cfg(hidden_size=12)  # wrong width
    with pytest.raises(E, match=r"embedding/kernel checkpoint \(4, 4, 3, 8\) vs model \(4, 4, 3, 12\)"):
        load(template(wide, 5), path, wide, 5)
    # every mismatch once: a mis-shaped array was also listed as 'unexpected in checkpoint', and the
    # posemb and cls twice as mis-shaped
    with pytest.raises(E) as err:
        load(template(wide, 5), path, wide, 5)
    msg = str(err.value)
    assert msg.splitlines()[0].startswith(f"cannot load init_from {path}: the model config differs "
                                          "from the checkpoint in width (checkpoint 8, model 12); ")
    assert "unexpected" not in msg and msg.count("shape mismatch: cls ") == 2  # first line + list
    assert msg.count("shape mismatch: embedding/kernel ") == 1
    renamed = {("Transformer/encoderblock_0/MlpBlock_3/Dense_0/kern" if k.endswith("0/kernel") and
                "encoderblock_0/MlpBlock" in k else k): v for k, v in good.items()}
    with pytest.raises(E) as err:  # a missing array: no 'mlp (checkpoint ?, model 16)'
        load(params, write(tmp_path / "renamed.npz", renamed), cfg, 5)
    assert "?" not in str(err.value).splitlines()[0] and "differs" not in str(err.value)
    timm_like = write(tmp_path / "timm.npz", {"patch_embed.proj.weight": np.zeros((8, 3, 4, 4), np.float32),
                                              "blocks.0.norm1.weight": np.ones(8, np.float32)})
    with pytest.raises(E, match=rf"^cannot load init_from {re.escape(timm_like)}: no 'embedding/kernel'.*"
                                r"timm / PyTorch state dict"):
        load(params, timm_like, cfg, 5)
    gap_ckpt = write(tmp_path / "gap.npz", vit_jax_file(logical(10, token=False)))
    with pytest.raises(E, match="classifier='gap'"):
        load(params, gap_ckpt, cfg, 5)


# ----------------------------------------------------------------------------------------- export

def random_params(cfg: dict, ncls: int, seed: int) -> dict:
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda a: r.normal(size=a.shape).astype(a.dtype), template(cfg, ncls))


def test_export_import_round_trip_bit_exact(tmp_path):
    cfg = model_cfg(representation_size=6)
    params = random_params(cfg, 5, 11)
    out = tmp_path / "sub" / "model.npz"
    written = export.export_npz(frozen_dict.freeze(params), str(out), cfg, log=None)
    assert set(written) == set(flat(params)) and not (tmp_path / "sub" / "model.npz.tmp").exists()
    with np.load(out, allow_pickle=False) as z:  # plain vit_jax layout, readable without this package
        assert z["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel"].shape == (D, H, DH)
    new, rows, _ = load(template(cfg, 5), str(out), cfg, 5)
    a, b = flat(params), flat(new)
    half = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)  # bf16 params widen exactly
    got = export.export_npz(half, str(tmp_path / "bf16.npz"), cfg, log=None)
    k = "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"
    assert got[k].dtype == np.float32 and np.array_equal(got[k], np.asarray(flat(half)[k], np.float32))
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype and np.array_equal(a[k], b[k]), k
    assert {r.action for r in rows.values()} == {"loaded"}


def test_export_cli(tmp_path, monkeypatch):
    import ml_collections
    from absl import flags
    import normvit_jax

    cfg = model_cfg()
    params = random_params(cfg, 5, 12)
    calls = []

    def restore_weights(workdir, step=None, weights=None):
        calls.append((workdir, step, weights))
        c = ml_collections.ConfigDict({"model": cfg})
        return {"params": jax.tree.map(jnp.asarray, params)}, c, {"weights": "raw", "step": step}

    fake = types.ModuleType("normvit_jax.checkpoints")
    fake.restore_weights = restore_weights
    monkeypatch.setitem(sys.modules, "normvit_jax.checkpoints", fake)
    monkeypatch.setattr(normvit_jax, "checkpoints", fake, raising=False)
    export.define_flags()
    out = tmp_path / "model.npz"
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["export", f"--workdir={tmp_path}/run", f"--out={out}", "--step=7"])
    try:
        export.main(["export"])
    finally:
        flags.FLAGS.unparse_flags()
    assert calls == [(f"{tmp_path}/run", 7, None)]
    got = pretrained.load_npz(str(out))
    for k, v in flat(params).items():
        assert np.array_equal(got[k], v), k


def test_export_cli_with_real_run_checkpoint(tmp_path):
    """The CLI end to end on an Orbax checkpoint written by the train side's own save path."""
    from normvit_jax import checkpoints
    import ml_collections
    import subprocess

    cfg = model_cfg()
    params = random_params(cfg, 5, 13)
    config = ml_collections.ConfigDict({"model": cfg})
    workdir = tmp_path / "run"
    mngr = checkpoints.make_manager(str(workdir), async_save=False)
    checkpoints.save(mngr, 7, {"params": params, "step": np.int32(7)})
    mngr.wait_until_finished()
    mngr.close()
    checkpoints.config_path(str(workdir)).write_text(config.to_json_best_effort())
    out = tmp_path / "model.npz"
    proc = subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={workdir}",
                           f"--out={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = pretrained.load_npz(str(out))
    assert got.keys() == flat(params).keys()
    for k, v in flat(params).items():
        assert np.array_equal(got[k], v), k
    # the same command again (a newer checkpoint, the same --out) replaces the file: it stopped
    # with a FileExistsError traceback and left model.npz.tmp beside it
    params2 = random_params(cfg, 5, 14)
    checkpoints.save(mngr := checkpoints.make_manager(str(workdir), async_save=False), 9,
                     {"params": params2, "step": np.int32(9)})
    mngr.wait_until_finished()
    mngr.close()
    proc = subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={workdir}",
                           f"--out={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz", "run"]
    got = pretrained.load_npz(str(out))
    for k, v in flat(params2).items():
        assert np.array_equal(got[k], v), k


def test_finetune_cifar_config_variants():
    from configs import finetune_cifar
    from normvit_jax.train import setup

    c = finetune_cifar.get_config()
    assert (c.model.variant, c.data.image_size, c.data.name, c.batch_size, c.total_steps) == \
        ("B/16", 224, "cifar10", 512, 10_000)
    assert (c.optimizer.name, c.optimizer.learning_rate, c.optimizer.momentum, c.optimizer.grad_clip,
            c.schedule.name, c.schedule.warmup_steps) == ("sgd", 0.03, 0.9, 1.0, "cosine", 500)
    assert c.init_from == "gs://vit_models/imagenet21k/ViT-B_16.npz"
    for arg, variant, res in (("b32", "B/32", 224), ("l16,384,cifar100,accum8", "L/16", 384),
                              ("l32,identity", "L/32", 224), ("b16,augreg", "B/16", 224)):
        c = finetune_cifar.get_config(arg)
        setup.validate_config(c, 1)
        assert (c.model.variant, c.data.image_size) == (variant, res)
    assert c.init_from.startswith("gs://vit_models/augreg/B_16-i21k")
    c = finetune_cifar.get_config("l16,384,cifar100,accum8")
    assert c.grad_accum_steps == 8 and c.data.name == "cifar100"
    assert finetune_cifar.get_config("b32,identity").model.norm.name == "identity"
    with pytest.raises(ValueError, match="no AugReg"):
        finetune_cifar.get_config("l32,augreg")
    with pytest.raises(ValueError, match="unknown fine-tuning variant 'x'"):
        finetune_cifar.get_config("x")


# ------------------------------------------------------------------------------ scanned models

@pytest.mark.parametrize("extra", [{}, {"norm_overrides": {"block_1": {"name": "rmsnorm"}}}],
                         ids=["all_scanned", "block_1_unrolled"])
@pytest.mark.parametrize("kind", ["vit_jax", "big_vision_scanned", "big_vision_per_block"])
def test_scanned_model_loads_every_layout_as_the_unrolled_one(tmp_path, kind, extra):
    """model.scan=True: the same .npz gives the same parameters (stacked) and the same logits as
    the unrolled model, whose logits are checked against the float64 reference elsewhere."""
    from normvit_jax.models import scan_convert
    w = logical(5, slot=kind == "vit_jax")
    raw = vit_jax_file(w) if kind == "vit_jax" else big_vision_file(
        w, scanned=kind == "big_vision_scanned", bf16=False)
    path = write(tmp_path / f"{kind}.npz", raw)
    cfg = model_cfg(**extra)
    scfg = {**cfg, "scan": True}
    spec = models.spec_of(scfg, 5)
    assert spec.scan_length == (1 if extra else DEPTH)
    unrolled, _, _ = load(template(cfg, 5), path, cfg, 5)
    scanned, rows, _ = load(template(scfg, 5), path, spec, 5)
    assert "Transformer/encoderblock_0/LayerNorm_0/scale" in rows  # reported per block
    stacked = flat(scanned)["Transformer/encoderblock/LayerNorm_0/scale"]
    assert stacked.shape == (spec.scan_length, D)
    a, b = flat(scan_convert.to_layout(unrolled, spec)), flat(scanned)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    x = images((16, 16))
    np.testing.assert_allclose(logits(scfg, 5, scanned, x), logits(cfg, 5, unrolled, x),
                               rtol=1e-5, atol=1e-5)


def test_export_of_a_scanned_model_is_the_per_block_vit_jax_layout(tmp_path):
    """Exporting the stacked parameters of a scanned model writes the same keys and values as
    exporting the same parameters unrolled (docs/pretrained.md: Transformer/encoderblock_{i})."""
    from normvit_jax.models import scan_convert
    cfg = model_cfg(representation_size=6)
    spec = models.spec_of({**cfg, "scan": True})
    params = random_params(cfg, 5, 13)
    want = export.export_npz(params, str(tmp_path / "unrolled.npz"), cfg, log=None)
    got = export.export_npz({"params": scan_convert.to_layout(params, spec)},
                                str(tmp_path / "scanned.npz"), spec, log=None)
    assert "Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel" in got
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    with np.load(tmp_path / "scanned.npz", allow_pickle=False) as z:
        assert set(z.files) == set(want)


def test_loop_init_from_loads_the_npz_into_the_train_state(tmp_path):
    """The loop's own path (train/build.init_from_pretrained): an .npz exported from other weights
    lands in the fresh state, every array but the re-initialised head equal to the file's, on the
    state's shardings, with the optimizer state re-initialised for them."""
    from normvit_jax import sharding
    from normvit_jax.train import build, optimizer, setup
    from tests.conftest import tiny_demo_config

    cfg = tiny_demo_config()
    spec = setup.validate_config(cfg, jax.device_count())
    model = setup.create_model(cfg, 10, spec)
    tx, _ = optimizer.create(cfg, 6)
    mesh = sharding.make_mesh(cfg)
    state, shardings = setup.create_train_state(model, tx, (8, 8, 3), mesh, jax.random.key(0))
    donor, _ = setup.create_train_state(model, tx, (8, 8, 3), mesh, jax.random.key(1))
    donor_params = jax.tree.map(np.asarray, donor.params)
    path = str(tmp_path / "donor.npz")
    export.export_npz(donor_params, path, spec, log=None)
    cfg.init_from = path
    new = build.init_from_pretrained(cfg, spec, 10, state, tx, shardings)
    flat_new = traverse_util.flatten_dict(jax.tree.map(np.asarray, new.params), sep="/")
    flat_donor = traverse_util.flatten_dict(donor_params, sep="/")
    flat_init = traverse_util.flatten_dict(jax.tree.map(np.asarray, state.params), sep="/")
    loaded = [k for k in flat_donor if not k.startswith("head/")]
    assert len(loaded) > 10
    for k in loaded:
        np.testing.assert_array_equal(flat_new[k], flat_donor[k], err_msg=k)
        assert not np.array_equal(flat_new[k], flat_init[k]) or flat_init[k].std() == 0, k
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(new), jax.tree.leaves(shardings)))


# ------------------------------------------------------- export -> init_from of every method config

def _method_configs() -> list[str]:
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    return sorted(p.stem for p in root.glob("vit_*.py"))


@pytest.mark.parametrize("name", _method_configs())
def test_export_of_every_method_loads_back_bit_exactly(tmp_path, name):
    """docs/pretrained.md: an export 'loads back with config.init_from bit-exactly', whatever the
    norm: the norms' own parameters (DyT/Derf alpha, ScaleNorm g, DTN gates, RepBN eta, ...),
    RescaleViT's rescale_s and a late class token's posemb included. They stayed at init (noted
    'shape () != checkpoint ()') or the load stopped ('unexpected in checkpoint: ...rescale_s',
    DTN's posemb 'not a square grid')."""
    import importlib
    config = importlib.import_module(f"configs.{name}").get_config("demo")
    config.model.update(hidden_size=8, depth=4, num_heads=2, mlp_dim=16)
    m = models.create(config.model, 5)
    shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 8, 8, 3), jnp.float32))
    r = np.random.default_rng(3)
    params = jax.tree.map(lambda s: r.normal(size=s.shape).astype(s.dtype), shapes["params"])
    path = str(tmp_path / f"{name}.npz")
    export.export_npz(params, path, config.model, log=None)
    tmpl = jax.tree.map(lambda s: np.full(s.shape, SENTINEL, s.dtype), shapes["params"])
    new, rows, table = load(tmpl, path, config.model, 5, image_size=8)
    a, b = flat(params), flat(new)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), (k, rows.get(k))
    assert {r.action for r in rows.values()} == {"loaded"}, table


def test_init_from_that_does_not_load_leaves_no_run(tmp_path):
    """docs/faults.md: 'a failed start leaves nothing to clean up'. A truncated init_from passes the
    preflight zip check and fails when it is read, an architecture mismatch when it is mapped:
    both left config.json, classes.json, data.json and checkpoints/ in a new workdir (a run that
    never was; in a folder the user made, a config.json the next command was compared with). The
    file is now read before anything is written, and cli.run removes the workdir it created."""
    from normvit_jax import cli
    from tests.conftest import tiny_demo_config

    cfg = tiny_demo_config()  # digits, 8 px, patch 2, width 32, depth 2
    donor = random_params(model_cfg(hidden_size=32, depth=2, num_heads=2, mlp_dim=64, patch_size=2),
                          10, 21)
    good = str(tmp_path / "donor.npz")
    export.export_npz(donor, good, model_cfg(hidden_size=32, depth=2, num_heads=2, mlp_dim=64,
                                             patch_size=2), log=None)
    data = open(good, "rb").read()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    for bad, change in ((str(tmp_path / "trunc.npz"), {}), (good, {"model.hidden_size": 48})):
        c = tiny_demo_config(init_from=bad, **change)
        new = tmp_path / "runs" / "new"
        assert cli.run(c, str(new)) == cli.EXIT_CONFIG
        assert not new.exists(), sorted(os.listdir(new))
        mine = tmp_path / "mine"
        mine.mkdir(exist_ok=True)
        assert cli.run(c, str(mine)) == cli.EXIT_CONFIG
        assert sorted(os.listdir(mine)) == [".lock", "checkpoints"]  # a folder the user made stays
        assert os.listdir(mine / "checkpoints") == []


def test_resumed_run_keeps_its_weights_and_says_init_from_is_not_read(tmp_path, caplog):
    """A run started from init_from and resumed with init_from pointing at other weights
    (allow_config_change) continues from its own checkpoint, bit for bit, without reading the
    file, and says so (the log listed the changed init_from and nothing told that it was unused)."""
    from normvit_jax import checkpoints as ckpts, cli
    from tests.conftest import tiny_demo_config

    arch = model_cfg(hidden_size=32, depth=2, num_heads=2, mlp_dim=64, patch_size=2)
    paths = []
    for seed in (31, 32):
        paths.append(str(tmp_path / f"w{seed}.npz"))
        export.export_npz(random_params(arch, 10, seed), paths[-1], arch, log=None)
    wd = str(tmp_path / "wd")
    assert cli.run(tiny_demo_config(init_from=paths[0], total_steps=3), wd) == cli.EXIT_OK
    before = flat(ckpts.load_variables(wd, step=3)[0]["params"])
    with caplog.at_level("INFO"), caplog.at_level("INFO", logger="absl"):  # absl's own level too
        assert cli.run(tiny_demo_config(init_from=paths[1], total_steps=3, allow_config_change=True),
                       wd) == cli.EXIT_OK
    said = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("init_from ") for m in said)  # no load report: the file is not read
    assert f"config.init_from={paths[1]} is not read again: it initialises step 0 only " \
           "(--fresh starts over from it)." in said, said
    after = flat(ckpts.load_variables(wd, step=3)[0]["params"])
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


def test_init_from_a_run_folder_says_how_to_export_it(tmp_path):
    """Fine-tuning from a run of this project goes through its .npz export; init_from naming the
    run's workdir said only 'is a directory, not an .npz file'. It now gives the export command
    (a plain folder gets no such hint)."""
    from normvit_jax import preflight
    from tests.conftest import tiny_demo_config

    run = tmp_path / "run"
    (run / "checkpoints" / "6").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"^config.init_from='{re.escape(str(run))}' is a directory, "
                                         rf"not a checkpoint file; it holds a run: `python -m "
                                         rf"normvit_jax.export --workdir={re.escape(str(run))} "
                                         r"--out=FILE.npz`"):
        preflight.check(tiny_demo_config(init_from=str(run)), str(tmp_path / "new"))
    # a run's checkpoint folders name the run's workdir (was: 'not an .npz file' and no hint)
    for inner, step in ((run / "checkpoints" / "6", " --step=6"), (run / "checkpoints", "")):
        with pytest.raises(ValueError, match=rf"^config.init_from='{re.escape(str(inner))}' is a "
                                             rf"folder of the run {re.escape(str(run))}: `python -m "
                                             rf"normvit_jax.export --workdir={re.escape(str(run))}"
                                             rf"{step} --out=FILE.npz`"):
            preflight.check(tiny_demo_config(init_from=str(inner)), str(tmp_path / "new"))
    accepted = r"\(accepted: \.npz, \.safetensors, \.pth, \.pt, \.bin\)"
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match=rf"is a directory, not a checkpoint file {accepted}$"):
        preflight.check(tiny_demo_config(init_from=str(plain)), str(tmp_path / "new"))
    hub = tmp_path / "vit-base"  # an HF hub folder: pass the weights file inside it
    hub.mkdir()
    (hub / "model.safetensors").write_bytes(b"x")
    (hub / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"is a directory, not a checkpoint file {accepted}: pass "
                                         rf"the weights file in it, --config.init_from="
                                         rf"{re.escape(str(hub / 'model.safetensors'))}$"):
        preflight.check(tiny_demo_config(init_from=str(hub)), str(tmp_path / "new"))
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07\x12\x07pytorch" + bytes(20))
    with pytest.raises(ValueError, match=rf"m\.onnx': an \.onnx file, not a checkpoint "
                                         rf"{accepted}: pass the weights the model was exported "
                                         r"from"):
        preflight.check(tiny_demo_config(init_from=str(tmp_path / "m.onnx")), str(tmp_path / "new"))


@pytest.mark.parametrize("extra,note", [
    ({}, None),
    ({"qkv_bias": False}, "model.qkv_bias=False (others assume True)"),
    ({"classifier": "gap_fc_norm"}, "model.classifier='gap_fc_norm' (others assume 'token' or 'gap'"),
    ({"posemb": "sincos2d"}, "model.posemb='sincos2d' (others assume 'learn')"),
], ids=["standard", "no_qkv_bias", "gap_fc_norm", "sincos"])
def test_export_log_names_what_other_codebases_would_build_differently(tmp_path, extra, note):
    """docs/pretrained.md: 'The export log names every way a model differs from' the standard ViT.
    A model without q/k/v biases (the file lacks the arrays vit_jax and timm read) and one that
    normalises after pooling (fc_norm, no encoder_norm) were exported without a word."""
    cfg = model_cfg(**extra)
    lines: list[str] = []
    export.export_npz(random_params(cfg, 5, 3), str(tmp_path / "m.npz"), cfg, log=lines.append)
    notes = [x for x in "\n".join(lines).splitlines() if x.strip().startswith("note:")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0], notes

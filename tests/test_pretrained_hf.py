"""init_from with Hugging Face transformers' ViT state dicts (ViTForImageClassification / ViTModel),
on tiny random ones (depth 2, width 8, 2 heads, patch 4, 16 px) written here in HF's names.

The reference is test_pretrained_timm's float64 numpy forward of timm's ViT, read from the timm
state dict the HF one is written from (q/k/v split here, independently of the loader); HF's ViT
computes the same function (exact GELU) with LayerNorm eps 1e-12, which the model gets through
model.norm.epsilon (the reference's 1e-6 moves these logits by < 1e-6). Tolerance rtol=atol=1e-4.
The last test needs torch and transformers (skipped without them).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from normvit_jax import models, pretrained
from tests.test_pretrained_timm import DEPTH, NCLS, D, build, load, reference, timm_sd

EPS = {"norm": {"name": "layernorm", "epsilon": 1e-12}}


def hf_sd(sd: dict[str, np.ndarray], *, v5: bool = False, prefix: str = "vit.") -> dict[str, np.ndarray]:
    """A timm state dict under HF's ViT names: save_pretrained's (hub files), or transformers 5's
    model.state_dict() (``v5``)."""
    layer = "layers" if v5 else "encoder.layer"
    mods = ({"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.o_proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"} if v5 else
            {"norm1": "layernorm_before", "norm2": "layernorm_after",
             "attn.proj": "attention.output.dense", "mlp.fc1": "intermediate.dense",
             "mlp.fc2": "output.dense"})
    qkv = (("attention.q_proj", "attention.k_proj", "attention.v_proj") if v5 else
           ("attention.attention.query", "attention.attention.key", "attention.attention.value"))
    e = prefix + "embeddings."
    out = {e + "cls_token": sd["cls_token"], e + "position_embeddings": sd["pos_embed"],
           e + "patch_embeddings.projection.weight": sd["patch_embed.proj.weight"],
           e + "patch_embeddings.projection.bias": sd["patch_embed.proj.bias"],
           prefix + "layernorm.weight": sd["norm.weight"], prefix + "layernorm.bias": sd["norm.bias"],
           "classifier.weight": sd["head.weight"], "classifier.bias": sd["head.bias"]}
    for i in range(DEPTH):
        b, h = f"blocks.{i}.", f"{prefix}{layer}.{i}."
        for t, name in mods.items():
            for p in ("weight", "bias"):
                out[f"{h}{name}.{p}"] = sd[f"{b}{t}.{p}"]
        for p in ("weight", "bias"):
            for name, part in zip(qkv, np.split(sd[f"{b}attn.qkv.{p}"], 3, axis=0)):
                out[f"{h}{name}.{p}"] = np.ascontiguousarray(part)
    return out


@pytest.mark.parametrize("v5", [False, True], ids=["save_pretrained", "state_dict_v5"])
def test_hf_logits_match_float64_forward(tmp_path, v5):
    sd = timm_sd(21)
    save_file(hf_sd(sd, v5=v5), str(tmp_path / "model.safetensors"))
    spec, net, params, x = build(**EPS)
    lines = []
    new, rows = pretrained.init_from_npz(params, str(tmp_path / "model.safetensors"), spec, NCLS,
                                         log=lines.append)
    assert {r.action for r in rows} == {"loaded"}, [r for r in rows if r.action != "loaded"]
    assert "numbering=hf" in lines[0] and "eps 1e-12" not in lines[0]
    spec0, _, params0, _ = build()  # the default LayerNorm eps (1e-6)
    pretrained.init_from_npz(params0, str(tmp_path / "model.safetensors"), spec0, NCLS,
                             log=lines.append)
    assert "HF's ViT LayerNorm uses eps 1e-12 (layer_norm_eps), the model 1e-06" in lines[1]
    got = np.asarray(net.apply({"params": new}, x))
    want = reference(sd, np.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 0.5


def test_hf_vitmodel_pooler_is_pre_logits(tmp_path):
    """ViTModel (no prefix) with its tanh pooler: loaded as pre_logits into a model with
    representation_size=D; without it, dropped (reported) and the head zeroed (vit_jax's rule)."""
    sd = timm_sd(22)
    r = np.random.default_rng(23)
    hf = hf_sd(sd, prefix="")
    hf["pooler.dense.weight"] = (r.normal(size=(D, D)) * 0.4).astype(np.float32)
    hf["pooler.dense.bias"] = (r.normal(size=D) * 0.4).astype(np.float32)
    save_file(hf, str(tmp_path / "model.safetensors"))
    spec, net, params, x = build(representation_size=D, **EPS)
    new, rows = load(params, tmp_path / "model.safetensors", spec)
    assert {r.action for r in rows} == {"loaded"}
    # HF: head(tanh(pooler(norm(x)[:, 0]))); norm(x)[:, 0] is the reference with an identity head
    ident = dict(sd, **{"head.weight": np.eye(D, dtype=np.float32), "head.bias": np.zeros(D, np.float32)})
    feat = reference(ident, np.asarray(x))
    pooled = np.tanh(feat @ hf["pooler.dense.weight"].astype(np.float64).T + hf["pooler.dense.bias"])
    want = pooled @ sd["head.weight"].astype(np.float64).T + sd["head.bias"]
    np.testing.assert_allclose(np.asarray(net.apply({"params": new}, x)), want, rtol=1e-4, atol=1e-4)
    spec, _, params, _ = build(**EPS)
    _, rows = load(params, tmp_path / "model.safetensors", spec)
    assert sum(r.action == "dropped" and r.source.startswith("pre_logits") for r in rows) == 2
    assert {r.action for r in rows if r.param.startswith("head/")} == {"reinit"}


def test_hf_config_json_beside_the_file_is_checked(tmp_path):
    """The heads are not in the weights (q/k/v are (D, D) for 1, 2, 4 or 8 heads: the file loads
    into a 4-head model and computes another function); a hub folder's config.json says them."""
    save_file(hf_sd(timm_sd(25)), str(tmp_path / "model.safetensors"))
    cfg = {"model_type": "vit", "num_attention_heads": 4, "hidden_act": "gelu", "layer_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec, _, params, _ = build(**EPS)
    with pytest.raises(pretrained.CheckpointError, match=r"its config\.json says num_attention_heads=4, "
                                                         r"the model has num_heads=2") as e:
        load(params, tmp_path / "model.safetensors", spec)
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=2)))
    lines = []
    pretrained.init_from_npz(params, str(tmp_path / "model.safetensors"), spec, NCLS, log=lines.append)
    assert "HF's ViT LayerNorm uses eps 1e-05 (layer_norm_eps), the model 1e-12" in lines[0]
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=2,
                                                          hidden_act="gelu_new")))
    lines = []
    pretrained.init_from_npz(params, str(tmp_path / "model.safetensors"), spec, NCLS, log=lines.append)
    assert "config.json says hidden_act='gelu_new', the tanh form" in lines[0]  # with the eps note
    assert "HF's ViT LayerNorm uses eps 1e-05" in lines[0]
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=2, hidden_act="relu")))
    with pytest.raises(pretrained.CheckpointError, match=r"hidden_act='relu'; this ViT's MLP uses GELU"):
        load(params, tmp_path / "model.safetensors", spec)


@pytest.mark.parametrize("extra, message", [
    ({"deit.embeddings.distillation_token": (1, 1, D)}, r"a distillation token .*distillation_token"),
    ({"vit.embeddings.mask_token": (1, 1, D)}, r"a mask token"),
    ({"decoder.decoder_embed.weight": (D, D)}, r"a pre-training decoder .*save the encoder alone"),
    ({"blocks.0.norm1.weight": (D,)}, r"the keys mix two layouts: HF transformers' .* and timm's "
                                      r"\(blocks\.0\.norm1\.weight\)"),
], ids=["deit_distilled", "mask_token", "mae_decoder", "mixed_with_timm"])
def test_hf_refusals_are_one_line(tmp_path, extra, message):
    hf = hf_sd(timm_sd(24))
    hf.update({k: np.full(s, 0.1, np.float32) for k, s in extra.items()})
    save_file(hf, str(tmp_path / "model.safetensors"))
    spec, _, params, _ = build(**EPS)
    with pytest.raises(pretrained.CheckpointError, match=message) as e:
        load(params, tmp_path / "model.safetensors", spec)
    assert "\n" not in str(e.value)


def test_hf_names_in_an_npz_are_named(tmp_path):
    np.savez(str(tmp_path / "hf.npz"), **hf_sd(timm_sd(26)))
    spec, _, params, _ = build(**EPS)
    with pytest.raises(pretrained.CheckpointError, match=r"its keys are an HF transformers ViT state "
                                                         r"dict .*save it as \.safetensors"):
        load(params, tmp_path / "hf.npz", spec)


def test_real_transformers_vit_logits(tmp_path):
    """transformers' own ViTForImageClassification (random init, weights perturbed), written by
    save_pretrained (model.safetensors) and by torch.save(model.state_dict()) (transformers 5's
    names, .bin): eval logits within 1e-4 of this model's with model.norm.epsilon=1e-12."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=8, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=16, num_labels=5)
    m = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    m.save_pretrained(str(tmp_path / "hub"))
    torch.save(m.state_dict(), str(tmp_path / "sd.bin"))
    x = np.random.default_rng(7).normal(size=(3, 16, 16, 3)).astype(np.float32)
    with torch.no_grad():
        want = m(pixel_values=torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).logits.numpy()
    for eps in (1e-12, 1e-6):
        spec = models.spec_of(dict(name="vit", patch_size=4, hidden_size=8, depth=2, num_heads=2,
                                   mlp_dim=16, gelu_approximate=False,
                                   norm={"name": "layernorm", "epsilon": eps}), 5)
        net = models.create(spec)
        params = net.init(jax.random.PRNGKey(0), jnp.asarray(x))["params"]
        for path in (tmp_path / "hub" / "model.safetensors", tmp_path / "sd.bin"):
            new, _ = pretrained.init_from_npz(params, str(path), spec, 5, log=None)
            got = np.asarray(net.apply({"params": new}, jnp.asarray(x)))
            print(f"max |logit diff| vs transformers (eps {eps}, {path.name}): "
                  f"{np.abs(got - want).max():.2e}")
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_hf_preprocessor_config_beside_the_file_names_the_input_normalization(tmp_path):
    """A hub folder's preprocessor_config.json records the inputs the model was trained on
    (google/vit-*: image_mean = image_std = 0.5, i.e. minus_one_one): the report notes a
    data.normalize that differs, and none where it agrees; without the file the note says what
    to check (as for timm's files)."""
    save_file(hf_sd(timm_sd(25)), str(tmp_path / "model.safetensors"))
    spec, _, params, _ = build(**EPS)

    def notes(normalize):
        lines = []
        pretrained.init_from_checkpoint(params, None, str(tmp_path / "model.safetensors"), spec,
                                        NCLS, normalize=normalize, log=lines.append)
        return [ln for ln in lines[0].splitlines() if "normalize" in ln]
    assert len(notes("minus_one_one")) == 1 and "preprocessor_config.json" in notes("zscore")[0]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_normalize": True}))
    assert notes("minus_one_one") == []
    assert notes("imagenet") == [
        "  note: inputs are data.normalize='imagenet'; the file's preprocessor_config.json says "
        "image_mean [0.5, 0.5, 0.5], image_std [0.5, 0.5, 0.5]: --config.data.normalize="
        "minus_one_one reproduces its inputs"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    assert notes("imagenet") == [] and "--config.data.normalize=imagenet" in notes("minus_one_one")[0]

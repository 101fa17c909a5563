"""ViT shapes, published parameter counts, placements and the analysis outputs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models


def _num_params(model, size):
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3))))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("variant,expected_millions", [("Ti/16", 5.7), ("S/16", 22.1), ("B/16", 86.6)])
def test_published_parameter_counts(variant, expected_millions):
    model = models.create({"variant": variant}, num_classes=1000)
    n = _num_params(model, 224)
    assert round(n / 1e6, 1) == expected_millions, n


def test_output_shape_and_google_names():
    model = models.create({"variant": "Ti/16", "depth": 2}, num_classes=7)
    variables = model.init(jax.random.key(0), jnp.zeros((2, 32, 32, 3)))
    p = variables["params"]
    assert p["embedding"]["kernel"].shape == (16, 16, 3, 192)
    assert p["cls"].shape == (1, 1, 192)
    assert p["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 5, 192)
    blk = p["Transformer"]["encoderblock_1"]
    assert set(blk) == {"LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3"}
    assert blk["MultiHeadDotProductAttention_1"]["query"]["kernel"].shape == (192, 3, 64)
    assert blk["MultiHeadDotProductAttention_1"]["out"]["kernel"].shape == (3, 64, 192)
    assert p["head"]["kernel"].shape == (192, 7)
    x = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
    assert model.apply(variables, x).shape == (2, 7)


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_patch_embedding_equals_convolution():
    """The (ph, pw, c)-ordered patchify + matmul is the conv with Google's kernel layout."""
    model = models.create({"variant": "Ti/8", "depth": 1}, num_classes=3)
    # jitted init: op by op a GPU compiles each primitive alone (14 s of `pytest -m gpu`)
    variables = jax.jit(lambda k: model.init(k, jnp.zeros((1, 16, 16, 3))))(jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (2, 16, 16, 3))
    k = variables["params"]["embedding"]["kernel"]
    b = variables["params"]["embedding"]["bias"]
    ref = jax.lax.conv_general_dilated(x, k, (8, 8), "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC")) + b
    from normvit_jax.models.layers import PatchEmbed
    ours = PatchEmbed(8, 192, "none", jnp.float32).apply({"params": variables["params"]["embedding"]}, x)
    np.testing.assert_allclose(ours, ref.reshape(2, 4, 192), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_placements_and_classifiers_run(placement, classifier):
    model = models.create({"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2,
                           "norm_placement": placement, "classifier": classifier,
                           "posemb": "sincos2d", "patch_norm": "dual"}, num_classes=4)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = model.init(jax.random.key(0), x)
    out = model.apply(variables, x)
    assert out.shape == (2, 4) and bool(jnp.all(jnp.isfinite(out)))
    names = set(variables["params"]["Transformer"]["encoderblock_0"])
    assert ("PostNorm_attn" in names) == (placement == "sandwich")
    assert "patch_norm_pre" in variables["params"]["embedding"]


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_attention_capture_rows_sum_to_one_and_match_fused_path():
    model = models.create({"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2},
                          num_classes=4)
    x = jax.random.normal(jax.random.key(0), (3, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    fused = model.apply(variables, x)
    logits, inter = model.apply(variables, x, capture=True, mutable=["intermediates"])
    np.testing.assert_allclose(logits, fused, rtol=1e-5, atol=1e-6)
    att = inter["intermediates"]["Transformer"]["encoderblock_0"]["MultiHeadDotProductAttention_1"]["attention"][0]
    assert att.shape == (3, 2, 5, 5)
    np.testing.assert_allclose(att.sum(-1), 1.0, rtol=1e-6)
    # Without 'intermediates' mutable nothing is recorded and nothing extra is returned.
    assert model.apply(variables, x, capture=True).shape == (3, 4)


def test_norm_overrides_and_late_class_token():
    model = models.create({"variant": "Ti/4", "depth": 3, "hidden_size": 16, "num_heads": 2,
                           "norm": {"name": "identity"}, "cls_token_at_block": 2,
                           "norm_overrides": {"blocks_2_3": {"name": "layernorm"},
                                              "final": {"name": "layernorm"}}}, num_classes=4)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    p = variables["params"]["Transformer"]
    assert "LayerNorm_0" not in p["encoderblock_0"]        # identity has no parameters
    assert "scale" in p["encoderblock_2"]["LayerNorm_0"]   # the override
    assert "scale" in p["encoder_norm"]
    assert p["posembed_input"]["pos_embedding"].shape == (1, 4, 16)  # no class slot: it joins late


@pytest.mark.parametrize("bad,match", [
    ({"variant": "X/16"}, "model.variant='X/16'"),
    ({"variant": "Ti/16", "classifier": "max"}, "model.classifier='max'"),
    ({"variant": "Ti/16", "norm_placement": "middle"}, "accepted: \\['pre', 'post', 'sandwich'\\]"),
    ({"variant": "Ti/16", "norm_overrides": {"blocks_3_99": {"name": "layernorm"}}}, "blocks_3_99"),
    ({"variant": "Ti/16", "hidden_size": 100, "num_heads": 3}, "model.num_heads=3 does not divide model.hidden_size=100"),
])
def test_bad_model_configs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        models.create(bad, num_classes=10)


def test_switching_the_norm_by_name_on_another_methods_config():
    """`--config.model.norm.name=layernorm` on the DTN config: DTN's options are left behind in
    the locked ConfigDict and must be ignored, while a misspelt option still fails."""
    from configs import vit_dtn
    c = vit_dtn.get_config("demo")
    c.model.norm.name = "layernorm"
    model = models.create(c.model, num_classes=10)
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    assert variables["params"]["Transformer"]["encoderblock_0"]["LayerNorm_0"]["scale"].shape == (64,)
    c.model.norm = {"name": "layernorm", "epsilonn": 1e-5}
    with pytest.raises(ValueError, match="epsilonn"):
        models.create(c.model, num_classes=10).init(jax.random.key(1), x)


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_attention_impls_compute_the_same_function():
    """'fused' (einsum attention), 'fused_sdpa' (jax.nn.dot_product_attention, cuDNN's on GPU),
    'separate' and 'auto' share parameters and agree in logits and gradients; on CPU 'auto' is
    'fused' (the same program)."""
    x = jax.random.normal(jax.random.key(0), (3, 8, 8, 3))
    cfg = {"variant": "Ti/4", "depth": 2, "hidden_size": 16, "num_heads": 2}
    ref = models.create({**cfg, "attention_impl": "fused"}, num_classes=4)
    variables = ref.init(jax.random.key(1), x)
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    variables = jax.tree.unflatten(tree, [a + 0.2 * jax.random.normal(k, a.shape)
                                          for a, k in zip(leaves, keys)])
    def out(model):
        loss = lambda v: jnp.sum(jnp.sin(model.apply(v, x)))
        return jax.jit(lambda v: (model.apply(v, x), jax.grad(loss)(v)))(variables)
    want_logits, want_grads = out(ref)
    assert float(jnp.abs(want_logits).max()) > 0.1
    program = lambda model: str(jax.make_jaxpr(lambda v: model.apply(v, x))(variables))
    fused_program = program(ref)
    for impl in ("auto", "fused_sdpa", "separate"):
        model = models.create({**cfg, "attention_impl": impl}, num_classes=4)
        if impl == "auto" and jax.default_backend() == "cpu":
            assert program(model) == fused_program  # the same program: nothing more to compare
            continue
        if impl == "fused_sdpa":
            assert program(model) != fused_program
        logits, grads = out(model)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_overlapping_norm_overrides_the_narrowest_wins():
    """Keys of a ConfigDict come back sorted, so precedence cannot be the keys' order."""
    ov = {"last_3": {"name": "rmsnorm"}, "block_4": {"name": "identity"},
          "blocks_0_5": {"name": "groupnorm"}, "final": {"name": "scalenorm"}}
    spec = models.spec_of({"variant": "Ti/16", "depth": 6, "norm_overrides": ov})
    got = [spec.block_norm(i)["name"] for i in range(6)]
    assert got == ["groupnorm", "groupnorm", "groupnorm", "rmsnorm", "identity", "rmsnorm"]
    assert spec.final_norm_config()["name"] == "scalenorm"
    assert [n["name"] for n in spec.slot_norms] == got + ["scalenorm"]


def test_spec_is_resolved_once_hashable_and_round_trips():
    """from_config fills the variant's sizes, the default norm and absolute block positions;
    equal configs give equal (and equally hashed) specs; to_config -> from_config is the same
    spec; ViT's one field is the spec."""
    from configs import vit_dtn
    from normvit_jax.models import ViTSpec
    c = vit_dtn.get_config("demo")
    spec = ViTSpec.from_config(c.model, 10)
    again = models.spec_of(c, 10)  # a whole run config: its model, with the given num_classes
    assert spec == again and hash(spec) == hash(again)
    assert (spec.depth, spec.hidden_size, spec.cls_token_at_block) == (4, 64, 2)
    assert dict(spec.norm_overrides) == {"blocks_2_4": {"name": "layernorm", "epsilon": 1e-5},
                                          "final": {"name": "layernorm", "epsilon": 1e-5}}
    assert spec.scan_length == 2 and spec.block_has_cls() == [False, False, True, True]
    assert ViTSpec.from_config(spec.to_config(), 10) == spec
    plain = models.spec_of({"variant": "S/16"})
    assert plain.norm == {"name": "layernorm"} and plain.mlp_dim == 1536
    assert plain.num_classes is None and plain.scan_length == 12
    model = models.create(spec)
    assert isinstance(model, models.FAMILIES["vit"]) and model.spec is spec
    assert [f.name for f in dataclasses.fields(model) if f.name not in ("parent", "name")] == ["spec"]
    with pytest.raises(ValueError, match="model.name='resnet' is not known"):
        models.spec_of({"name": "resnet", "variant": "S/16"})


@pytest.mark.parametrize("impl", ["fused", "separate"])
def test_param_init_schemes_follow_their_references(impl):
    """'timm' (DeiT, T2T-ViT): every Linear normal(0.02) with zero bias, class token normal(0.02),
    patch embedding torch Conv2d's default uniform(+-1/sqrt(fan_in)); 'google' (vit_jax): xavier
    uniform attention kernels, zero head and class token. Sample statistics on S-sized layers."""
    spec = dict(hidden_size=384, depth=1, num_heads=6, mlp_dim=1536, patch_size=16,
                attention_impl=impl)
    init = lambda scheme: models.create(dict(spec, param_init=scheme), 1000).init(
        jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    t, g = init("timm"), init("google")
    tb, gb = (p["Transformer"]["encoderblock_0"] for p in (t, g))
    for layer in (tb["MultiHeadDotProductAttention_1"]["query"], tb["MultiHeadDotProductAttention_1"]["out"],
                  tb["MlpBlock_3"]["Dense_0"], tb["MlpBlock_3"]["Dense_1"], t["head"]):
        k = np.asarray(layer["kernel"])
        assert abs(k.std() - 0.02) < 0.001 and abs(k.mean()) < 0.001
        assert not np.asarray(layer.get("bias", 0.0)).any()
    assert abs(np.asarray(t["cls"]).std() - 0.02) < 0.005
    bound = 1 / np.sqrt(16 * 16 * 3)
    emb = np.asarray(t["embedding"]["kernel"])
    assert np.abs(emb).max() <= bound and abs(emb.std() - bound / np.sqrt(3)) < 0.05 * bound
    assert np.abs(np.asarray(t["embedding"]["bias"])).max() <= bound
    q = np.asarray(gb["MultiHeadDotProductAttention_1"]["query"]["kernel"])
    assert abs(q.std() - np.sqrt(2 / (384 + 384))) < 0.002  # xavier on (D, D)
    assert not np.asarray(g["head"]["kernel"]).any() and not np.asarray(g["cls"]).any()


def _ln64(x, scale, bias, eps=1e-6):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
@pytest.mark.parametrize("patch_norm", ["pre", "post", "dual", "post_posemb"])
def test_dual_patchnorm_placements_against_float64(patch_norm):
    """Dual PatchNorm (Kumar et al. 2023): LayerNorm over each patch's P*P*3 pixels in (row,
    column, channel) order before the patch Dense ('pre', 'dual'), LayerNorm over D after it
    ('post', 'dual') or after the position embedding ('post_posemb', class token included).
    Float64 reference of the stem on pixels with per-channel offsets, the LayerNorms' scale and
    bias random (a swapped order, a missing norm or the wrong axis moves the outputs by O(1))."""
    p, d = 4, 16
    model = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": d, "num_heads": 2,
                           "patch_norm": patch_norm}, num_classes=4)
    rng = np.random.default_rng(0)
    images = (rng.normal(size=(2, 8, 8, 3)) * 0.3 + [0.5, -2.0, 4.0]).astype(np.float32)
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(0), images))
    params = variables["params"]
    post = params["Transformer"] if patch_norm == "post_posemb" else params
    norms = {"pre": params["embedding"].get("patch_norm_pre"), "post": post.get("patch_norm_post")}
    for n in norms.values():
        if n is not None:
            n["scale"] = (1 + 0.5 * rng.normal(size=n["scale"].shape)).astype(np.float32)
            n["bias"] = (0.3 * rng.normal(size=n["bias"].shape)).astype(np.float32)
    assert (norms["pre"] is not None) == (patch_norm in ("pre", "dual"))
    assert (norms["post"] is not None) == (patch_norm != "pre")
    _, state = model.apply(variables, images, capture_intermediates=True, mutable=["intermediates"])
    got = state["intermediates"]

    x = images.astype(np.float64).reshape(2, 2, p, 2, p, 3).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(2, 4, p * p * 3)
    if norms["pre"] is not None:
        x = _ln64(x, norms["pre"]["scale"], norms["pre"]["bias"])
    e = params["embedding"]
    x = x @ e["kernel"].astype(np.float64).reshape(p * p * 3, d) + e["bias"]
    np.testing.assert_allclose(got["embedding"]["__call__"][0], x, rtol=1e-5, atol=1e-5)
    if patch_norm in ("post", "dual"):
        want = _ln64(x, norms["post"]["scale"], norms["post"]["bias"])
        np.testing.assert_allclose(got["patch_norm_post"]["__call__"][0], want, rtol=1e-5,
                                   atol=1e-5)
    if patch_norm == "post_posemb":  # [cls, patches] + the learned table, then the norm
        tokens = np.concatenate([np.broadcast_to(params["cls"], (2, 1, d)), x], 1)
        tokens = tokens + params["Transformer"]["posembed_input"]["pos_embedding"]
        want = _ln64(tokens, norms["post"]["scale"], norms["post"]["bias"])
        np.testing.assert_allclose(got["Transformer"]["patch_norm_post"]["__call__"][0], want,
                                   rtol=1e-5, atol=1e-5)


def test_rescale_residuals_are_rescalevits():
    """RescaleViT's residuals (docs/norms.md): x1 = x + Attn(y1); out = sqrt(i/(i+1)) * x1 +
    (s/sqrt(L)) * MLP(y2), i the 1-based block index, s learnable. The block's inputs are read
    back from its Rescale slots (eval: y = x + b - mu0, b and mu0 set here), the branches from
    the captured attention and MLP outputs; the other tests compare layouts of the same
    formula, so a wrong coefficient passed them."""
    depth, d = 3, 16
    model = models.create({"variant": "Ti/4", "depth": depth, "hidden_size": d, "num_heads": 2,
                           "norm": {"name": "rescale"}, "residual_scaling": "rescale",
                           "final_norm": False}, num_classes=4)
    images = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(1), images))
    rng = np.random.default_rng(2)
    for i in range(depth):
        block = variables["params"]["Transformer"][f"encoderblock_{i}"]
        block["rescale_s"] = np.float32(rng.uniform(0.5, 2.0))
        for slot in ("LayerNorm_0", "LayerNorm_2"):
            block[slot]["bias"] = rng.normal(size=d).astype(np.float32)
            variables["batch_stats"]["Transformer"][f"encoderblock_{i}"][slot]["mu0"] = \
                rng.normal(size=d).astype(np.float32)
    _, state = model.apply(variables, images, capture_intermediates=True,
                           mutable=["intermediates"])
    got = state["intermediates"]["Transformer"]

    def slot_input(i, slot):  # the Rescale slot's input from its eval output
        y = np.asarray(got[f"encoderblock_{i}"][slot]["__call__"][0], np.float64)
        p = variables["params"]["Transformer"][f"encoderblock_{i}"][slot]
        s = variables["batch_stats"]["Transformer"][f"encoderblock_{i}"][slot]
        return y - p["bias"] + s["mu0"]

    for i in range(depth):
        g = got[f"encoderblock_{i}"]
        x1 = slot_input(i, "LayerNorm_0") + g["MultiHeadDotProductAttention_1"]["__call__"][0]
        np.testing.assert_allclose(slot_input(i, "LayerNorm_2"), x1, rtol=1e-4, atol=1e-4)
        s = float(variables["params"]["Transformer"][f"encoderblock_{i}"]["rescale_s"])
        out = (np.sqrt((i + 1) / (i + 2)) * x1
               + s / np.sqrt(depth) * np.asarray(g["MlpBlock_3"]["__call__"][0], np.float64))
        nxt = (slot_input(i + 1, "LayerNorm_0") if i + 1 < depth
               else np.asarray(got["__call__"][0], np.float64))
        np.testing.assert_allclose(nxt, out, rtol=1e-4, atol=1e-4, err_msg=f"block {i}")


@pytest.mark.parametrize("at", [1, 2])
def test_late_class_token_joins_at_its_block_as_the_parameter(at):
    """cls_token_at_block=k (DTN's layout): blocks before k see the patch tokens alone, block k
    sees [cls, patches] with the class token as its parameter (no position embedding), and the
    head reads it. A token joining one block late (or never, for k = depth - 1) passed the
    parameter-shape test above."""
    depth = 3
    model = models.create({"variant": "Ti/4", "depth": depth, "hidden_size": 16, "num_heads": 2,
                           "norm": {"name": "identity"}, "final_norm": False,
                           "cls_token_at_block": at}, num_classes=4)
    images = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = jax.tree.map(np.asarray, model.init(jax.random.key(1), images))
    cls = np.random.default_rng(3).normal(size=16).astype(np.float32)  # Google's init is zeros
    variables["params"]["cls"] = cls.reshape(1, 1, 16)
    _, state = model.apply(variables, images, capture_intermediates=True,
                           mutable=["intermediates"])
    got = state["intermediates"]["Transformer"]
    for i in range(depth):
        tokens = np.asarray(got[f"encoderblock_{i}"]["LayerNorm_0"]["__call__"][0])
        assert tokens.shape[1] == (4 if i < at else 5), (i, tokens.shape)
        if i == at:
            np.testing.assert_array_equal(tokens[:, 0], np.broadcast_to(cls, (2, 16)))

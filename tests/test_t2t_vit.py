"""T2T-ViT (models/t2t_vit.py) against independent references: torch Unfold's documented layout
and the reference Token_performer's formulas in numpy float64, the published T2T-ViT-14 size
(21.5M parameters, 4.8G multiply-adds at 224), every variant's parameter count against the
original's layer list and its README, and the sinusoid table's formula."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models, pretrained, reparam
from normvit_jax.analysis import flops
from normvit_jax.models import t2t_vit
from normvit_jax.models.layers import sincos_1d

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU


def tiny(norm: str = "layernorm", **extra) -> dict:
    cfg = dict(name="t2t_vit", hidden_size=32, depth=2, num_heads=2, mlp_dim=48, patch_size=16,
               token_dim=16, posemb="sincos1d", qkv_bias=False, gelu_approximate=False,
               norm={"name": norm})
    cfg.update(extra)
    return cfg


def numpy_unfold(x: np.ndarray, k: int, s: int, p: int) -> np.ndarray:
    """torch.nn.Unfold as documented, on NCHW, loops: (B, C*k*k, L) with channel-major
    features (c, i, j) and row-major blocks; returned transposed to (B, L, C*k*k)."""
    b, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    out = np.zeros((b, c * k * k, ho * wo))
    for ch in range(c):
        for i in range(k):
            for j in range(k):
                for oh in range(ho):
                    for ow in range(wo):
                        out[:, ch * k * k + i * k + j, oh * wo + ow] = xp[:, ch, oh * s + i, ow * s + j]
    return out.transpose(0, 2, 1)


@pytest.mark.parametrize("shape,split", [((2, 16, 16, 3), (7, 4, 2)), ((1, 9, 7, 5), (3, 2, 1)),
                                         ((2, 8, 8, 4), (3, 2, 1))])
def test_soft_split_is_torch_unfold(shape, split):
    x = np.random.default_rng(0).standard_normal(shape)
    got, hw = t2t_vit.soft_split(jnp.asarray(x, jnp.float32), *split)
    want = numpy_unfold(x.transpose(0, 3, 1, 2), *split)
    assert got.shape == want.shape and hw[0] * hw[1] == want.shape[1]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


def test_soft_splits_take_224_to_a_14x14_grid():
    x = jnp.zeros((1, 224, 224, 3))
    sides = []
    for split in t2t_vit.SOFT_SPLITS:
        x, hw = t2t_vit.soft_split(x, *split)
        sides.append(hw)
        x = x[..., :4].reshape(1, *hw, 4)
    assert sides == [(56, 56), (28, 28), (14, 14)]


def test_random_features_are_orthogonal_and_fixed():
    for emb, m in ((64, 32), (8, 20)):
        w = t2t_vit.random_features(emb, m, seed=1).astype(np.float64)
        assert w.shape == (m, emb)
        gram = w @ w.T if m <= emb else w.T @ w  # orthonormal rows / columns, times sqrt(m)
        np.testing.assert_allclose(gram, m * np.eye(min(m, emb)), atol=1e-4 * m)
    np.testing.assert_array_equal(t2t_vit.random_features(64, 32, 1), t2t_vit.random_features(64, 32, 1))
    assert np.abs(t2t_vit.random_features(64, 32, 1) - t2t_vit.random_features(64, 32, 2)).max() > 0.1


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _ln(x, p, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * p["scale"] + p["bias"]


def numpy_token_performer(x, p, w, eps, norm=None):
    """The reference Token_performer.forward in float64 (dropout off); ``norm(x, slot params)``
    replaces the LayerNorms when given."""
    f = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    norm = norm or (lambda y, q: _ln(y, q, eps))
    emb = f["proj"]["kernel"].shape[0]
    kqv = norm(x, f["norm1"]) @ f["kqv"]["kernel"] + f["kqv"]["bias"]
    k, q, v = kqv[..., :emb], kqv[..., emb:2 * emb], kqv[..., 2 * emb:]
    m = w.shape[0]
    prm = lambda z: np.exp(z @ w.T - (z * z).sum(-1, keepdims=True) / 2) / math.sqrt(m)
    kp, qp = prm(k), prm(q)
    d = np.einsum("bti,bi->bt", qp, kp.sum(1))[..., None]
    kptv = np.einsum("bin,bim->bnm", v, kp)
    y = np.einsum("bti,bni->btn", qp, kptv) / (d + 1e-8)
    y = v + y @ f["proj"]["kernel"] + f["proj"]["bias"]
    h = _gelu(norm(y, f["norm2"]) @ f["mlp_0"]["kernel"] + f["mlp_0"]["bias"])
    return y + h @ f["mlp_2"]["kernel"] + f["mlp_2"]["bias"]


def test_token_performer_matches_the_reference_formulas():
    norm = models.spec_of(tiny()).norm  # layernorm
    layer = t2t_vit.TokenPerformer(16, 0.5, 0.1, norm, (3, 4), 7, jnp.float32)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 12, 27))
    params = layer.init(jax.random.key(0), jnp.zeros((2, 12, 27)), False)["params"]
    # random parameters (not the init's zeros and ones), scaled so the exponentials stay moderate
    params = jax.tree.map(lambda a: 0.3 * rng.standard_normal(a.shape).astype(np.float32), params)
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(x, jnp.float32), False))
    eps = float(norm.get("epsilon", 1e-6))
    want = numpy_token_performer(x, params, t2t_vit.random_features(16, 8, 7).astype(np.float64), eps)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    # dropout acts in training only
    train = layer.apply({"params": params}, jnp.asarray(x, jnp.float32), True,
                        rngs={"dropout": jax.random.key(1)})
    assert np.abs(np.asarray(train) - got).max() > 1e-3


@pytest.mark.parametrize("step,lam", [(0, 1.0), (5, 0.5), (9, 0.0)])
def test_stem_progressive_norm_follows_the_train_step(step, lam):
    """A progressive norm in the stem gets the global train step: lam * LN(x) + (1 - lam) * x
    (N2 identity; warm-up 1, decay 8, linear: lam 1 / 0.5 / 0 at steps 0 / 5 / 9)."""
    norm = models.spec_of(tiny(stem_norm={
        "name": "progressive", "n1": {"name": "layernorm", "epsilon": 1e-6},
        "n2": {"name": "identity"}, "warmup_steps": 1, "decay_steps": 8})).stem_norm_config
    layer = t2t_vit.TokenPerformer(16, 0.5, 0.0, norm, (3, 4), 7, jnp.float32)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 12, 27))
    params = layer.init(jax.random.key(0), jnp.zeros((2, 12, 27)), True, 0)["params"]
    params = jax.tree.map(lambda a: 0.3 * rng.standard_normal(a.shape).astype(np.float32), params)
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(x, jnp.float32), True,
                                 jnp.asarray(step)))
    mix = lambda y, q: lam * _ln(y, q["n1"], 1e-6) + (1 - lam) * y
    want = numpy_token_performer(x, params, t2t_vit.random_features(16, 8, 7).astype(np.float64),
                                 1e-6, norm=mix)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_model_passes_the_step_to_a_progressive_stem_norm():
    model = models.create(models.spec_of(tiny(stem_norm={
        "name": "progressive", "n2": {"name": "identity"}, "decay_steps": 4}), 5))
    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    # jitted (one compile each, not one per operation); the step is traced, as in the train step
    v = jax.jit(functools.partial(model.init, train=False))(
        {"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
    head = v["params"]["head"]  # the init's zero head would hide any difference
    v = {**v, "params": {**v["params"], "head": {
        "kernel": jax.random.normal(jax.random.key(4), head["kernel"].shape), "bias": head["bias"]}}}
    apply = jax.jit(lambda v, k: model.apply(v, x, train=True, step=k,
                                             rngs={"dropout": jax.random.key(3)},
                                             mutable=["batch_stats"])[0])
    out = [apply(v, jnp.asarray(k)) for k in (0, 4)]
    assert np.abs(np.asarray(out[0]) - np.asarray(out[1])).max() > 1e-4  # LN vs identity stem


def test_positive_features_estimate_softmax_attention():
    """What the Performer stands for: with many features, qp . kp estimates exp(q . k), so the
    normalised weights approach softmax(q k^T)."""
    rng = np.random.default_rng(0)
    q, k = 0.4 * rng.standard_normal((1, 5, 8)), 0.4 * rng.standard_normal((1, 6, 8))
    w = jnp.asarray(t2t_vit.random_features(8, 20_000, seed=0))
    qp = np.asarray(t2t_vit._positive_features(jnp.asarray(q, jnp.float32), w), np.float64)[0]
    kp = np.asarray(t2t_vit._positive_features(jnp.asarray(k, jnp.float32), w), np.float64)[0]
    approx = qp @ kp.T
    approx /= approx.sum(-1, keepdims=True)
    logits = q[0] @ k[0].T
    exact = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert np.abs(approx - exact).max() < 0.02
    assert np.abs(np.full_like(exact, 1 / 6) - exact).max() > 0.05  # the check can tell


def test_sincos_1d_is_the_published_table():
    n, d = 7, 10
    want = np.array([[pos / np.power(10000, 2 * (j // 2) / d) for j in range(d)] for pos in range(n)])
    want[:, 0::2], want[:, 1::2] = np.sin(want[:, 0::2]), np.cos(want[:, 1::2])
    np.testing.assert_allclose(sincos_1d(n, d)[0], want, atol=1e-6)


def test_t2t_vit_14_has_the_published_size():
    """T2T-ViT-14: 21.5M parameters and 4.8G MACs at 224 (Yuan et al. 2021, Table; the UN
    paper's model)."""
    spec = models.spec_of(dict(name="t2t_vit", variant="T2T-14", qkv_bias=False), 1000)
    assert (spec.hidden_size, spec.depth, spec.num_heads, spec.mlp_dim) == (384, 14, 6, 1152)
    shapes = jax.eval_shape(lambda: models.create(spec).init(
        jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False))
    n = sum(math.prod(a.shape) for a in jax.tree.leaves(shapes["params"]))
    assert abs(n / 1e6 - 21.5) < 0.05, n
    assert abs(flops.analytic_flops(spec, 224) / 2 / 1e9 - 4.8) < 0.05
    from normvit_jax.train import progress
    assert progress.describe_model(spec).startswith("T2T-ViT-14 (depth 14, width 384")
    small = models.spec_of(dict(name="t2t_vit", variant="T2T-14", depth=2))
    assert progress.describe_model(small).startswith("T2T-ViT (depth 2") and "depth" in \
        progress.describe_model(small).split("overridden")[0].split("with")[-1]


def test_model_runs_with_un_everywhere_and_another_stem_norm():
    cfg = tiny("unified", stem_norm={"name": "layernorm"})
    spec = models.spec_of(cfg, 5)
    model = models.create(spec)
    x = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))
    variables = jax.jit(functools.partial(model.init, train=False))(
        {"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)  # one compile
    stem = variables["params"]["tokens_to_token"]
    assert set(stem) == {"attention1", "attention2", "project"}
    assert set(stem["attention1"]["norm1"]) == {"scale", "bias"}  # LayerNorm's, not UN's
    assert "tokens_to_token" not in variables["batch_stats"]        # UN state only in the blocks
    blk = variables["params"]["Transformer"]["encoderblock_0"]["MultiHeadDotProductAttention_1"]
    assert "bias" not in blk["query"] and "bias" in blk["out"]      # qkv_bias=False
    apply = jax.jit(lambda v, x, r: model.apply(v, x, train=True, rngs={"dropout": r},
                                                mutable=["batch_stats"]))
    logits, _ = apply(variables, x, jax.random.key(3))
    assert logits.shape == (4, 5) and np.isfinite(np.asarray(logits)).all()
    assert spec.slot_norm_name("tokens_to_token/attention2/norm1") == "layernorm"
    assert spec.slot_norm_name("Transformer/encoderblock_1/LayerNorm_0") == "unified"
    assert models.spec_of(spec.to_config(), 5) == spec
    with pytest.raises(pretrained.CheckpointError, match="another stem"):
        pretrained.init_from_npz(variables, "unused.npz", spec, 5)


def test_fused_and_separate_attention_agree_without_qkv_bias():
    cfg = tiny()
    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    fused = models.create(dict(cfg, attention_impl="fused"), 5)
    variables = jax.jit(lambda k, a: fused.init(k, a, train=False))(jax.random.key(1), x)
    variables = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), variables)
    separate = models.create(dict(cfg, attention_impl="separate"), 5)
    np.testing.assert_allclose(np.asarray(jax.jit(separate.apply)(variables, x)),
                               np.asarray(jax.jit(fused.apply)(variables, x)), rtol=1e-5, atol=1e-5)


def test_un_folds_into_the_stem_and_blocks():
    from tests.test_reparam import random_variables
    cfg = tiny("unified")
    variables = jax.jit(lambda: random_variables(dict(cfg)))()  # one compile, not op by op
    images = jax.random.normal(jax.random.key(7), (3, 16, 16, 3))
    want = np.asarray(jax.jit(models.create(cfg, 5).apply)(variables, images))
    spec, folded, report = reparam.fold(cfg, variables)
    got = np.asarray(jax.jit(models.create(spec, 5).apply)(folded, images))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert {f"tokens_to_token/attention{i}/norm{j}" for i in (1, 2) for j in (1, 2)} <= set(report.folded)
    assert spec.stem_norm["name"] == "identity" and spec.qkv_bias and not report.kept


@pytest.mark.parametrize("extra,match", [
    (dict(patch_size=8), "patch_size=8"), (dict(patch_norm="dual"), "patch_norm"),
    (dict(variant="S/16", hidden_size=None), "T2T-ViT preset"),
    (dict(stem_norm={"name": "nonesuch"}), "nonesuch"),
])
def test_bad_settings_are_named(extra, match):
    with pytest.raises(ValueError, match=match):
        models.spec_of(tiny(**extra), 5)


def original_counts(d: int, depth: int, mlp_ratio: float, token_dim: int = 64, classes: int = 1000
                    ) -> tuple[int, int]:
    """(trainable, frozen) parameters of yitu-opensource/T2T-ViT's T2T_ViT (performer stem), from
    its layer list: Token_performer(dim, in_dim=token_dim) = norm1(dim), kqv(dim, 3e)+b, proj(e, e)+b,
    norm2(e), mlp (e, e)+b twice; frozen: each performer's w (e/2, e) and pos_embed (197, d)."""
    e, h = token_dim, int(d * mlp_ratio)

    def performer(dim: int) -> int:
        return 2 * dim + (dim + 1) * 3 * e + (e + 1) * e + 2 * e + 2 * (e + 1) * e

    block = 2 * d + d * 3 * d + (d + 1) * d + 2 * d + (d + 1) * h + (h + 1) * d  # qkv_bias=False
    trainable = (performer(3 * 49) + performer(e * 9) + (e * 9 + 1) * d + d  # stem, project, cls
                 + depth * block + 2 * d + (d + 1) * classes)               # blocks, norm, head
    return trainable, 2 * (e // 2) * e + (14 * 14 + 1) * d


# Published sizes (M parameters) of the performer models: yitu-opensource/T2T-ViT README.md tables.
PUBLISHED_M = {"T2T-7": 4.3, "T2T-10": 5.9, "T2T-12": 6.9, "T2T-14": 21.5, "T2T-19": 39.2,
               "T2T-24": 64.1}
PUBLISHED_GMACS = {"T2T-7": 1.1, "T2T-10": 1.5, "T2T-12": 1.8, "T2T-14": 4.8, "T2T-19": 8.5,
                   "T2T-24": 13.8}  # same tables, at 224


@pytest.mark.parametrize("variant", list(PUBLISHED_M))
def test_parameter_counts_are_the_originals(variant):
    """Our model as the presets build it (fixed sinusoid table, no qkv bias) holds exactly the
    original's trainable parameters; the published figure is torch's model.parameters(), frozen
    pos_embed and performer w included (without them T2T-10/19/24 would round to 5.8/39.1/64.0)."""
    d, depth, heads, ratio = t2t_vit.T2T_VARIANTS[variant]
    spec = models.spec_of(dict(name="t2t_vit", variant=variant, qkv_bias=False,
                               posemb="sincos1d"), 1000)
    assert (spec.hidden_size, spec.depth, spec.num_heads, spec.mlp_dim) == \
        (d, depth, heads, int(d * ratio))
    shapes = jax.eval_shape(lambda: models.create(spec).init(
        jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False))["params"]
    n = sum(math.prod(a.shape) for a in jax.tree.leaves(shapes))
    trainable, frozen = original_counts(d, depth, ratio)
    assert n == trainable
    assert round((n + frozen) / 1e6, 1) == PUBLISHED_M[variant]
    stem = jax.tree.map(lambda a: a.shape, shapes[t2t_vit.STEM_SCOPE])
    assert stem["attention1"]["kqv"]["kernel"] == (147, 192)  # Token_performer(dim=3*7*7, in_dim=64)
    assert stem["attention2"]["kqv"]["kernel"] == (576, 192)  # Token_performer(dim=64*3*3, in_dim=64)
    assert stem["project"]["kernel"] == (576, d)
    # our count (linear layers + attention + stem) vs theirs: 13.66 for T2T-24, others within .05
    assert abs(flops.analytic_flops(spec, 224) / 2e9 - PUBLISHED_GMACS[variant]) < 0.15


def test_t2t_vit_14_presets_are_the_original_model():
    """configs vit_ln/vit_un :t2t_vit_14 build T2T-ViT-14 with the original's trainable size
    (21,465,806: qkv_bias=False, fixed sinusoid table, head_dim**-0.5 since qk_scale is only set
    for pretrained=True) and its stem settings."""
    import configs.vit_ln
    import configs.vit_un
    for mod in (configs.vit_ln, configs.vit_un):
        spec = models.spec_of(mod.get_config("t2t_vit_14").model.to_dict(), 1000)
        assert (spec.posemb, spec.qkv_bias, spec.param_init, spec.classifier) == \
            ("sincos1d", False, "timm", "token")
        assert (spec.token_dim, spec.kernel_ratio, spec.t2t_dropout_rate) == (64, 0.5, 0.1)
        shapes = jax.eval_shape(lambda: models.create(spec).init(
            jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False))["params"]
        assert sum(math.prod(a.shape) for a in jax.tree.leaves(shapes)) == 21_465_806 == \
            original_counts(384, 14, 3.0)[0]

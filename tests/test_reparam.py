"""Folding inference-time affine norms into the next Dense (normvit_jax/reparam.py).

Reference: the unfolded model's eval logits on random images, with every parameter and running
statistic drawn at random (not at their init values, where a fold could be trivially right).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from normvit_jax import models, reparam
from normvit_jax.models import scan_convert
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config

NUM_CLASSES = 5
SIZE = 16


def tiny_model_cfg(norm: str, **extra) -> dict:
    return dict(hidden_size=32, depth=2, num_heads=2, mlp_dim=64, patch_size=4,
                norm={"name": norm}, **extra)


def random_variables(cfg: dict, seed: int = 0) -> dict:
    """Init, then every leaf replaced by random values; variance-like statistics kept positive."""
    model = models.create(cfg, NUM_CLASSES)
    variables = model.init(jax.random.key(seed), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in ("'var'", "running_var", "buffer_x2")):
            out.append(jax.random.uniform(key, leaf.shape, minval=0.3, maxval=3.0))
        elif any(s in name for s in ("'t'", "'count'", "'skips'")):
            out.append(leaf + 50.0)
        else:
            scale = 0.3 if leaf.ndim > 1 else 1.0
            out.append(scale * jax.random.normal(key, leaf.shape))
    return jax.tree_util.tree_unflatten(tree, out)


def eval_logits(cfg: Any, variables: dict, images: jax.Array) -> np.ndarray:
    return np.asarray(models.create(cfg, NUM_CLASSES).apply(variables, images, train=False))


def slot_names(variables: dict) -> set[str]:
    flat = scan_convert.unstack_blocks(jax.tree.map(np.asarray, variables))
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(flat)[0]}


IMAGES = jax.random.normal(jax.random.key(7), (6, SIZE, SIZE, 3))


@pytest.mark.parametrize("norm,extra", [
    ("batchnorm", {}),
    ("unified", {}),
    ("learnable_scaler", {"classifier": "gap"}),
    ("rescale", {"residual_scaling": "rescale", "final_norm": False}),
    ("batchnorm", {"representation_size": 24, "scan": True}),
])
@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_folded_model_computes_the_same_logits(norm, extra):
    cfg = tiny_model_cfg(norm, **extra)
    variables = random_variables(cfg)
    want = eval_logits(cfg, variables, IMAGES)
    folded_spec, folded, report = reparam.fold(cfg, variables)
    got = eval_logits(folded_spec, folded, IMAGES)
    # float32 model; the fold itself is computed in float64.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    final = [] if extra.get("final_norm") is False else ["Transformer/encoder_norm"]
    assert sorted(report.folded) == sorted(
        [f"Transformer/encoderblock_{i}/{s}" for i in range(2) for s in ("LayerNorm_0", "LayerNorm_2")]
        + final)
    assert not report.kept
    names = slot_names(folded)
    assert not any("LayerNorm_" in n or "encoder_norm" in n for n in names), names
    assert scan_convert.is_scanned(folded) == bool(extra.get("scan"))
    # The check can fail: dropping the norms without changing the Dense layers gives other logits.
    dropped = scan_convert.to_layout({"params": folded["params"]}, folded_spec)
    unfolded_dense = scan_convert.unstack_blocks(jax.tree.map(np.asarray, variables))["params"]
    flat_dropped = scan_convert.unstack_blocks(dropped)["params"]
    for k in flat_dropped:
        if k != "Transformer":
            flat_dropped[k] = unfolded_dense[k]
    for b, block in flat_dropped["Transformer"].items():
        if b.startswith("encoderblock_"):
            for sub in block:
                block[sub] = unfolded_dense["Transformer"][b][sub]
    wrong = eval_logits(folded_spec, scan_convert.to_layout({"params": flat_dropped}, folded_spec),
                        IMAGES)
    assert np.abs(wrong - want).max() > 100 * np.abs(got - want).max() + 1e-3


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_only_the_foldable_slots_fold_in_a_mixed_model():
    cfg = tiny_model_cfg("unified", norm_overrides={"block_1": {"name": "dtn"},
                                                    "final": {"name": "powernorm"}})
    variables = random_variables(cfg, seed=3)
    want = eval_logits(cfg, variables, IMAGES)
    folded_spec, folded, report = reparam.fold(cfg, variables)
    np.testing.assert_allclose(eval_logits(folded_spec, folded, IMAGES), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    assert report.folded == ["Transformer/encoderblock_0/LayerNorm_0",
                             "Transformer/encoderblock_0/LayerNorm_2"]
    kept = dict(report.kept)
    assert "dtn" in kept["Transformer/encoderblock_1"]
    assert "powernorm" in kept["Transformer/encoder_norm"]
    assert dict(folded_spec.norm_overrides)["block_0"] == {"name": "identity"}
    assert [n["name"] for n in folded_spec.slot_norms] == ["identity", "dtn", "powernorm"]


def _folding_norms() -> list[str]:
    from normvit_jax import norms
    return [n for n in norms.known_names()
            if reparam.foldable({"name": n}) or reparam.splittable({"name": n})]


@pytest.mark.parametrize("norm", _folding_norms())
@pytest.mark.usefixtures("float32_matmuls")
def test_every_registered_norm_that_folds_keeps_its_logits(norm):
    """Every registry name whose class has inference_affine or split_affine, with its default
    options: a norm added to the registry is held to its fold without editing a test (the
    parametrized tests above and in test_reparam_dynamic.py name the shipped ones)."""
    extra = {"rescale": {"residual_scaling": "rescale"}}.get(norm, {})
    cfg = tiny_model_cfg(norm, **extra)
    variables = random_variables(cfg)
    # Running statistics positive whatever their name (a variance named otherwise would be
    # negative and give NaN logits on both sides, which assert_allclose calls equal).
    variables["batch_stats"] = jax.tree.map(lambda v: jnp.abs(v) + 0.3,
                                            variables.get("batch_stats", {}))
    want = eval_logits(cfg, variables, IMAGES)
    assert np.isfinite(want).all()
    folded_spec, folded, report = reparam.fold(cfg, variables)
    np.testing.assert_allclose(eval_logits(folded_spec, folded, IMAGES), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())
    assert "Transformer/encoderblock_0/LayerNorm_0" in report.folded


class RunningStatsNoAffine(nn.Module):
    """Test-only user norm: running statistics in batch_stats, no inference_affine."""

    @nn.compact
    def __call__(self, x, train=False):
        ms = self.variable("batch_stats", "ms", jnp.ones, (x.shape[-1],), jnp.float32)
        return x * jax.lax.rsqrt(ms.value + 1e-5)


class SaysWhyNotFolded(RunningStatsNoAffine):
    NOT_FOLDED = "its own reason"


class SplitsWithoutSaying(RunningStatsNoAffine):
    def split_affine(self, params, stats):
        ones = jnp.ones((stats["ms"].shape[-1],), jnp.float32)
        return ones, 0 * ones, {}, {}


def test_the_kept_reason_comes_from_the_norm_class_not_its_name(monkeypatch):
    """A norm added to the registry gets a true reason: what its class says (NOT_FOLDED,
    SPLIT_KEEPS), else that it has no inference_affine (reparam named powernorm and progressive
    and said 'statistics of each token' of every other norm, running statistics or not)."""
    from normvit_jax.norms import registry
    for name, cls in (("user_running", "RunningStatsNoAffine"), ("user_says", "SaysWhyNotFolded"),
                      ("user_split", "SplitsWithoutSaying")):
        monkeypatch.setitem(registry._ENTRIES, name, f"{__name__}:{cls}")
    kept = {}
    for name in ("user_running", "user_says", "user_split", "powernorm", "layernorm", "dyt"):
        cfg = tiny_model_cfg(name)
        kept[name] = dict(reparam.fold(cfg, random_variables(cfg))[2].kept)["Transformer/encoder_norm"]
    assert kept["user_running"] == ("user_running: RunningStatsNoAffine has no inference_affine"
                                    "(params, stats) (its eval output is not declared a fixed "
                                    "per-channel affine)")
    assert kept["user_says"] == "user_says: its own reason"
    assert kept["user_split"] == "user_split: scale/bias folded, the rest of the norm stays"
    # the shipped norms' reasons, now class attributes, read as before
    assert kept["powernorm"] == ("powernorm: its group scaling divides each token by its own RMS "
                                 "at inference")
    assert kept["layernorm"] == "layernorm: statistics of each token at inference, not a fixed affine"
    assert kept["dyt"] == "dyt: scale/bias folded, tanh(alpha * x) stays"
    prog = {"name": "progressive", "eval_mode": "mixture"}
    assert reparam._why_kept(prog) == ("progressive: evaluates the mixture with N1 "
                                       "(eval_mode='mixture') or its N2 does not fold")


def test_layernorm_model_is_left_as_it_is():
    cfg = tiny_model_cfg("layernorm")
    variables = random_variables(cfg, seed=5)
    folded_spec, folded, report = reparam.fold(cfg, variables)
    assert not report.folded and len(report.kept) == 3
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(folded)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_post_norm_placement_is_refused():
    cfg = tiny_model_cfg("batchnorm", norm_placement="post")
    with pytest.raises(ValueError, match="norm_placement='post'"):
        reparam.fold(cfg, random_variables(cfg))


@pytest.mark.usefixtures("float32_matmuls")  # float32 numerics: no TF32 on GPU
def test_command_folds_a_trained_run(tmp_path, capsys):
    # one block (the folds of every block are checked above): 3 slots, its 2 and the final norm
    cfg = tiny_demo_config(total_steps=3, checkpoint_every=3, eval_every=3, **{"model.depth": 1})
    cfg.model.norm = {"name": "batchnorm"}
    loop.train_and_evaluate(cfg, str(tmp_path))
    saved = tmp_path / "folded"
    out = reparam.main(["--workdir", str(tmp_path), "--batch", "4", "--reps", "1",
                        "--out", str(saved)])
    text = capsys.readouterr().out
    assert "folded 3 norm slot(s)" in text
    # the slot's norm by name, not only its Google-layout parameter name (issue 35, item 7)
    assert "folded batchnorm (before the MLP) at Transformer/encoderblock_0/LayerNorm_2" in text
    assert out["max_diff"] < 1e-3
    # The saved folded model loads back and computes the trained run's eval logits.
    from normvit_jax import checkpoints
    variables, config = checkpoints.load_variables(str(tmp_path))
    model_cfg, folded, num_classes = reparam.load(str(saved))
    images = jax.random.normal(jax.random.key(3), (4, config.data.image_size, config.data.image_size, 3))
    want = models.create(config.model, num_classes).apply(variables, images, train=False)
    got = models.create(model_cfg, num_classes).apply(folded, images, train=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    assert "LayerNorm_0" not in folded["params"]["Transformer"]["encoderblock_0"]
    with pytest.raises(FileNotFoundError, match="reparam.save"):
        reparam.load(str(tmp_path / "nothing"))


def test_save_into_a_folder_saved_before_replaces_it(tmp_path):
    """Re-running ``reparam --out=DIR`` with the same DIR (its docstring's
    ``--out=runs/demo_un/folded``) replaces the folded model; the rename refused an existing file."""
    cfg = tiny_model_cfg("batchnorm")
    reparam.save(str(tmp_path), cfg, random_variables(cfg, seed=1), NUM_CLASSES)
    second = random_variables(cfg, seed=2)
    reparam.save(str(tmp_path), cfg, second, NUM_CLASSES)
    _, loaded, _ = reparam.load(str(tmp_path))
    for a, b in zip(jax.tree.leaves(second), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "variables.msgpack"]


@pytest.mark.parametrize("name", ["model.json", "variables.msgpack"])
def test_a_damaged_folded_folder_names_the_file(tmp_path, name):
    """A truncated model.json or variables.msgpack (a copy cut short) gave JSON's or msgpack's
    message alone ('Expecting ':' delimiter: line 4 column 17', 'Unpack failed: incomplete
    input'): predict --folded printed it naming no file."""
    cfg = tiny_model_cfg("batchnorm")
    reparam.save(str(tmp_path), cfg, random_variables(cfg), NUM_CLASSES)
    whole = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=rf"^{tmp_path / name} is damaged \(.+\); write the "
                                         rf"folder again: python -m normvit_jax\.reparam "):
        reparam.load(str(tmp_path))


@pytest.mark.parametrize("stop_at_write", [1, 2])
def test_a_save_stopped_part_way_is_never_read_as_a_mixed_model(tmp_path, monkeypatch,
                                                                 stop_at_write):
    """Ctrl-C during a re-run's ``--out`` save: after the weights were replaced the earlier
    model.json was still there, so ``load`` returned the new weights with the old model's config
    (here a DyT model's weights read as a BatchNorm model). Now a stopped save leaves either the
    earlier folder or one ``load`` refuses."""
    from etils import epath
    first_cfg, second_cfg = tiny_model_cfg("batchnorm"), tiny_model_cfg("dyt")
    first, second = random_variables(first_cfg, seed=1), random_variables(second_cfg, seed=2)
    reparam.save(str(tmp_path), first_cfg, first, NUM_CLASSES)
    cls, writes = type(epath.Path(tmp_path)), []

    def interrupted(original):
        def write(self, *args, **kwargs):
            if str(self).startswith(str(tmp_path)):  # not JAX's compilation cache
                writes.append(self.name)
            if len(writes) == stop_at_write:
                raise KeyboardInterrupt
            return original(self, *args, **kwargs)
        return write

    monkeypatch.setattr(cls, "write_bytes", interrupted(cls.write_bytes))
    monkeypatch.setattr(cls, "write_text", interrupted(cls.write_text))
    with pytest.raises(KeyboardInterrupt):
        reparam.save(str(tmp_path), second_cfg, second, NUM_CLASSES)
    monkeypatch.undo()
    try:
        model_cfg, loaded, _ = reparam.load(str(tmp_path))
    except FileNotFoundError:
        return  # refused: the user sees the save did not finish
    assert model_cfg["norm"]["name"] == "batchnorm"  # the earlier save, whole
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("patch_norm", ["none", "post"])
def test_input_affine_folds_into_the_patch_embedding(patch_norm):
    """Folded into the patch embedding, the pixels' per-channel affine gives the same logits on
    raw pixels as the model on ``x * scale + shift`` (random pixels 0..255, scale and shift unlike
    per channel, float32 within 1e-4 of logits ~1-10); stems that do not start with the linear
    patch map are refused (None)."""
    cfg = tiny_model_cfg("repbn", patch_norm=patch_norm)
    variables = random_variables(cfg)
    scale = np.array([0.017, 0.0175, 0.0171], np.float32)  # ImageNet's 1/(255*std)
    shift = np.array([-2.12, -2.04, -1.80], np.float32)     # -mean/std
    pixels = np.random.default_rng(3).integers(0, 256, (6, SIZE, SIZE, 3)).astype(np.float32)
    want = eval_logits(cfg, variables, jnp.asarray(pixels * scale + shift))
    folded = reparam.fold_input_affine(cfg, variables, scale, shift)
    got = eval_logits(cfg, folded, jnp.asarray(pixels))
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(folded["params"]["embedding"]["kernel"],
                              np.asarray(variables["params"]["embedding"]["kernel"]))
    dual = tiny_model_cfg("layernorm", patch_norm="dual")  # a norm on the raw patches
    assert reparam.fold_input_affine(dual, random_variables(dual), scale, shift) is None
    t2t = dict(name="t2t_vit", hidden_size=32, depth=1, num_heads=2, mlp_dim=48, patch_size=16,
               token_dim=16, norm={"name": "layernorm"})  # its stem attends over unfolded pixels
    assert reparam.fold_input_affine(t2t, {}, scale, shift) is None


def test_timing_with_too_few_repetitions_claims_no_ratio():
    """``--reps=1`` compared two single timings: a point 'spread' never overlaps, so the report
    said e.g. 'folded 10.36x as fast' from one noisy sample (seen on a DyT run)."""
    one = reparam.timing_summary([0.009], [0.0009], 4)
    assert "x as fast" not in one and "too few repetitions" in one
    two = reparam.timing_summary([0.020, 0.021], [0.010, 0.011], 4)
    assert "x as fast" not in two and "too few repetitions" in two
    three = reparam.timing_summary([0.020, 0.021, 0.022], [0.010, 0.0105, 0.011], 4)
    assert "folded 2.00x as fast" in three

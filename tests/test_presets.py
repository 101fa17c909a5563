"""The paper presets (configs/recipes.py): each builds, validates and, shrunk to a tiny model on
the digits data with its recipe otherwise intact, runs two train steps; the batch augmentations
act in the train step and not in evaluation."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from configs import recipes
from normvit_jax import cli, data, sharding
from normvit_jax.train import batch_aug, optimizer, setup
from tests.conftest import REPO_ROOT

ALL_PRESETS = [
    "vit_dtn.py:deit_t", "vit_dtn.py:deit_s", "vit_dtn.py:deit_b", "vit_ln.py:bigvision_s16_90ep",
    "vit_ln.py:bigvision_s16_300ep", "vit_ln.py:deit_s", "vit_dpn.py:bigvision_s16_90ep",
    "vit_un.py:deit_s", "vit_learnable_scaler.py:paper", "vit_learnable_scaler.py:paper_d36",
    "vit_rescale.py:cifar10_b16", "vit_un.py:t2t_vit_14", "vit_ln.py:t2t_vit_14",
    "vit_repbn.py:slab_deit_t", "vit_progressive.py:slab_deit_s", "vit_dyt.py:dyt_b",
    "vit_dyt.py:dyt_l", "vit_derf.py:dyt_b", "vit_derf.py:dyt_l", "vit_dtn.py:deit_s,dtn_code",
]
# Trained shrunk: one per distinct recipe x normalizer (deit_t/_b and paper_d36 differ from
# deit_s and paper only in the model size, which the shrinking replaces).
TRAINED = ["vit_dtn.py:deit_s", "vit_ln.py:bigvision_s16_90ep", "vit_dpn.py:bigvision_s16_90ep",
           "vit_un.py:deit_s", "vit_learnable_scaler.py:paper", "vit_rescale.py:cifar10_b16",
           "vit_un.py:t2t_vit_14"]


def load(spec: str):
    return cli.load_config_file(os.path.join(REPO_ROOT, "configs", spec))


def shrink(c):
    """Tiny model on the 8x8 digits; the recipe's optimizer, schedule, augmentation, EMA,
    accumulation, repeated augmentation, norm and stem stay as the preset set them."""
    c.data.name, c.data.train_split, c.data.eval_split = "digits", "train", "test"
    c.data.image_size, c.data.normalize, c.data.random_resized_crop = 8, "zero_one", False
    c.data.num_eval_examples = 48
    c.model.variant = None
    # one block (compiles fastest), three where the class token joins two blocks from the end
    # (DTN's layout: cls_token_at_block=-2 needs a block before it)
    at = c.model.get("cls_token_at_block") or 0
    c.model.patch_size, c.model.hidden_size, c.model.depth = 2, 32, max(1, 1 - at)
    c.model.num_heads, c.model.mlp_dim = 2, 64
    if c.model.name == "t2t_vit":  # the soft splits' fixed stride 16: one 16x16 image = 1 token
        c.data.image_size, c.model.patch_size, c.model.token_dim = 16, 16, 8
    if c.model.representation_size:
        c.model.representation_size = 32
    c.batch_size, c.eval_batch_size = 48, 48   # divisible by accumulation 8 and repeats 3
    c.total_steps, c.schedule.warmup_steps = 2, min(c.schedule.warmup_steps, 1)
    c.dtype = "float32"
    c.eval_analysis_images = 0
    return c


def build(c):
    mesh = sharding.make_mesh()
    run_spec = setup.resolve_config(c, mesh.devices.size)
    ds = run_spec.data
    train = data.make_pipeline(c, "train", ds)
    model = setup.create_model(c, ds.num_classes, run_spec.model)
    tx, lr = optimizer.create(c, 2)
    state, state_sh = setup.create_train_state(model, tx, train.image_shape, mesh, jax.random.key(0))
    return mesh, train, model, tx, lr, ds, state, state_sh


@pytest.mark.parametrize("spec", ALL_PRESETS)
def test_preset_is_a_valid_run(spec):
    setup.validate_config(load(spec), 1)  # names, sizes, batch/accumulation, run length


@pytest.mark.parametrize("spec", TRAINED)
def test_preset_trains_two_steps_shrunk(spec):
    c = shrink(load(spec))
    mesh, train, model, tx, lr, ds, state, state_sh = build(c)
    step = setup.jit_train_step(setup.make_train_step(c, model, tx, lr, ds), state_sh, mesh)
    before = jax.tree.map(np.asarray, state.params)
    batches = train.train_batches(0)
    for _ in range(2):
        state, m = step(state, sharding.to_global(next(batches), mesh))
        assert np.isfinite(float(m.compute()["loss"]))
    batches.close()
    assert int(state.step) == 2
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before)
    assert max(jax.tree.leaves(moved)) > 0


def test_presets_carry_the_cited_values():
    """Spot checks against the sources quoted in configs/recipes.py."""
    d = load("vit_dtn.py:deit_s")
    assert (d.optimizer.learning_rate, d.optimizer.weight_decay, d.num_epochs) == (1e-3, 0.05, 300.0)
    assert (d.mixup_alpha, d.cutmix_alpha, d.switch_prob, d.random_erase_prob) == (0.8, 1.0, 0.5, 0.25)
    assert (d.label_smoothing, d.model.stochastic_depth, d.data.repeated_aug) == (0.1, 0.1, 3)
    assert d.ema_decay == 0.99996 and d.schedule.warmup_steps == 5 * (1_281_167 // 1024)
    assert load("vit_dtn.py:deit_t").model.num_heads == 4
    assert load("vit_dtn.py:deit_b").model.num_heads == 16
    assert d.model.norm.name == "dtn" and d.model.norm_overrides.final.name == "layernorm"
    b = load("vit_ln.py:bigvision_s16_90ep")
    assert (b.batch_size, b.optimizer.learning_rate, b.schedule.warmup_steps) == (1024, 1e-3, 10_000)
    # big_vision's decoupled wd 1e-4 (not scaled by lr) = optax.adamw's weight_decay * lr
    assert b.optimizer.weight_decay * b.optimizer.learning_rate == pytest.approx(1e-4)
    assert (b.model.classifier, b.model.posemb, b.mixup_alpha) == ("gap", "sincos2d", 0.2)
    assert load("vit_dpn.py:bigvision_s16_90ep").model.patch_norm == "dual"
    assert (d.data.interpolation, b.data.interpolation) == ("bicubic", "bilinear")  # timm / TF
    assert (d.model.param_init, b.model.param_init) == ("timm", "google")
    ls = load("vit_learnable_scaler.py:paper")
    assert (ls.optimizer.name, ls.batch_size, ls.grad_accum_steps, ls.optimizer.grad_clip) == \
        ("lamb", 2048, 8, 14.0)
    assert (ls.model.depth, ls.model.hidden_size, ls.model.patch_size) == (24, 192, 16)
    assert (ls.schedule.name, ls.schedule.epoch_factor, ls.schedule.epoch_threshold) == \
        ("ls_custom", 0.8, 0.5)
    assert (ls.optimizer.lamb_grad_clip, ls.data.normalize, ls.data.eval_crop_fraction) == \
        (1.0, "minus_one_one", 0.9)  # timm Lamb's max_grad_norm; the model cfg's mean/std 0.5, crop 0.9
    # README.md:86 --train-feature-decay 0.1 --attn-extra-loss 0.03 --attn-extra-loss-layers 6
    assert (ls.feature_decay, ls.feature_decay_threshold, ls.attn_extra_loss,
            ls.attn_extra_loss_layers) == (0.1, 200.0, 0.03, 6)
    # per-process Mixup draws and timm < 1.0.29's CutMix box where the source used timm
    assert [(x.mix_groups, x.cutmix_box) for x in (d, load("vit_dtn.py:deit_b"), ls)] == \
        [(4, "even"), (16, "even"), (8, "even")]
    assert (b.data.min_crop_area, b.data.antialias) == (0.05, False)  # ops_image.py area_min=5
    assert (b.data.eval_resize_small, b.data.image_size) == (256, 224)  # vit_s16_i1k.py:60
    dc = load("vit_dtn.py:deit_s,dtn_code")  # DTN's released code: no mixing or erasing, fp32
    assert (dc.batch_size, dc.optimizer.learning_rate, dc.mixup_alpha, dc.cutmix_alpha) == \
        (256, 2.5e-4, 0.0, 0.0)
    assert (dc.random_erase_prob, dc.model.qkv_bias, dc.dtype) == (0.0, False, "float32")
    t = load("vit_un.py:t2t_vit_14")
    assert (t.model.name, t.model.variant, t.batch_size, t.optimizer.learning_rate) == \
        ("t2t_vit", "T2T-14", 512, 5e-4)
    assert (t.schedule.warmup_steps, t.model.posemb, t.model.qkv_bias) == \
        (10 * (1_281_167 // 512), "sincos1d", False)
    spec = setup.validate_config(t, 1)
    assert spec.stem_norm_config["name"] == "unified" and spec.norm["outlier_filtration"]
    assert load("vit_ln.py:t2t_vit_14").model.norm.epsilon == 1e-5  # torch's LayerNorm
    r = load("vit_rescale.py:cifar10_b16")
    assert (r.model.variant, r.data.image_size, r.total_steps, r.batch_size) == ("B/16", 224, 20_000, 128)
    assert r.model.norm.name == "rescale" and r.optimizer.name == "sgd"
    assert (r.model.dropout_rate, r.model.attention_dropout_rate) == (0.1, 0.0)  # models/configs.py
    # RescaleViT's models/modeling.py:51,129 (seeds/001: on jeonsworld/ViT-pytorch): torch's exact
    # GELU, not the tanh approximation of Google's checkpoints
    assert r.model.gelu_approximate is False
    assert (t.mix_groups, t.dtype, t.data.eval_crop_fraction) == (8, "float32", 0.9)


def test_presets_name_policies_the_randaugment_parser_accepts():
    from normvit_jax.train import randaugment
    assert load("vit_dtn.py:deit_s").randaugment == recipes.RANDAUGMENT_DEIT
    assert load("vit_ln.py:bigvision_s16_90ep").randaugment == recipes.RANDAUGMENT_BIGVISION
    for policy, style, n, m in ((recipes.RANDAUGMENT_DEIT, "timm", 2, 9.0),
                                (recipes.RANDAUGMENT_BIGVISION, "bigvision", 2, 10.0),
                                (recipes.RANDAUGMENT_LS, "timm", 2, 7.0)):
        ra = randaugment.parse(policy)
        assert (ra.style, ra.num_layers, ra.magnitude) == (style, n, m)


def test_augmentation_acts_in_training_and_not_in_evaluation():
    """DeiT's batch augmentations (RandAugment, erasing, Mixup/CutMix) draw from the step key: the train step's
    gradient changes with the state's key; eval metrics do not (no augmentation reaches eval)."""
    c = shrink(load("vit_ln.py:deit_s"))
    c.model.stochastic_depth = 0.0  # leave the augmentations as the only use of the key
    c.schedule.warmup_steps = 0     # the first step updates the weights
    assert batch_aug.make(c, data.resolve_data_spec(c)) is not None
    mesh, train, model, tx, lr, ds, state, state_sh = build(c)
    step = jax.jit(setup.make_train_step(c, model, tx, lr, ds))  # no donation: state used twice
    ev = setup.jit_eval_step(model, state_sh, mesh)
    batch = sharding.to_global(train.train_batch(0), mesh)
    eval_batch = dict(batch, mask=np.ones(c.batch_size, np.float32))
    # another key placed as the state's own (an uncommitted array would compile the step again)
    other = state.replace(rng=jax.device_put(jax.random.key_data(jax.random.key(123)),
                                             state.rng.sharding))
    # The head starts at zero (loss log(10) for any input): compare gradients, then evaluate the
    # stepped weights, whose logits depend on the input.
    outs = [step(s, batch) for s in (state, other)]
    grad_norms = [float(m.compute()["grad_norm"]) for _, m in outs]
    assert grad_norms[0] != grad_norms[1]
    trained = outs[0][0]
    again = trained.replace(rng=other.rng)
    e = [ev(s, sharding.to_global(eval_batch, mesh)).compute() for s in (trained, again)]
    assert float(e[0]["loss"]) != pytest.approx(np.log(10), abs=1e-4)
    assert float(e[0]["loss"]) == float(e[1]["loss"]) and float(e[0]["top1"]) == float(e[1]["top1"])
    c.mixup_alpha = c.cutmix_alpha = c.random_erase_prob = 0.0  # all off: no transform at all
    c.randaugment = ""
    assert batch_aug.make(c, data.resolve_data_spec(c)) is None


@pytest.mark.parametrize("method", ["vit_rescale", "vit_learnable_scaler"])
def test_method_optimizer_keeps_the_variants_run_length(method):
    """A method config that sets its reference's optimizer outside ``:demo`` (RescaleViT's SGD,
    LearnableScaler's LAMB) must not overwrite the run shape ``:small32`` and ``:imagenet`` set:
    small32 is a fixed 300-step CPU recipe for any method, imagenet 300 epochs of 1024."""
    import importlib
    from configs import default
    module = importlib.import_module(f"configs.{method}")
    s = module.get_config("small32")
    assert (s.total_steps, s.batch_size) == (default.SMALL32_STEPS, 128)
    assert s.schedule.warmup_steps < s.total_steps
    i = module.get_config("imagenet")
    assert (i.total_steps, i.num_epochs, i.batch_size) == (None, 300.0, 1024)
    if method == "vit_rescale":
        # seeds/001 (RescaleViT README): batch 128, 20000 iterations, SGD, on CIFAR: the plain config
        c = module.get_config()
        assert (c.batch_size, c.total_steps, c.schedule.warmup_steps) == (128, 20_000, 500)
        assert (i.optimizer.name, s.optimizer.name, c.optimizer.learning_rate) == ("sgd", "sgd", 0.05)


def test_batch_statistics_are_per_gpu_process_as_the_references():
    """The references normalise with each GPU's own batch (no SyncBatchNorm): SLAB's RepBN over
    8 x 128 (SLAB README.md:65, config.py:22; main.py never converts), UN's T2T-ViT over 8 x 64
    (run_train.sh; main.py:189 --sync-bn off), DeiT's 4 x 256. Global statistics over the
    whole batch would be a different normaliser in training."""
    assert load("vit_repbn.py:slab_deit_t").model.norm.stats_group_size == 128
    assert load("vit_progressive.py:slab_deit_s").model.norm.n2.stats_group_size == 128
    assert load("vit_un.py:t2t_vit_14").model.norm.stats_group_size == 64
    assert load("vit_un.py:deit_s").model.norm.stats_group_size == 256
    for spec in ("vit_repbn.py:slab_deit_t", "vit_progressive.py:slab_deit_s", "vit_un.py:t2t_vit_14"):
        c = load(spec)
        setup.validate_config(c, 1)
        norm = c.model.norm.get("n2", c.model.norm) if c.model.norm.name == "progressive" else c.model.norm
        assert c.batch_size // norm.stats_group_size == c.mix_groups  # one group per process
    assert "stats_group_size" not in load("vit_dtn.py:deit_s").model.norm  # DTN: per-token


def test_readme_lists_every_preset():
    """README.md's 'Reproducing the papers' table names each preset in its first column
    (`vit_x.py:a`, `vit_x.py:a` / `:b`, `vit_ln.py:deit_t/_s/_b`), so the README's pointer there
    for a paper's recipe holds for every method that has one."""
    import re
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Reproducing the papers", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in (r for r in section.splitlines() if r.startswith("| `")):
        file = None
        for f, names in re.findall(r"`([\w.]*):([\w/]+)`", row.split("|")[1]):
            file = f or file
            first, *rest = names.split("/")
            stem = first.rsplit("_", 1)[0]
            listed |= {f"{file}:{first}"} | {f"{file}:{stem}{r}" for r in rest}
    missing = [s for s in ALL_PRESETS if not s.endswith(",dtn_code") and s not in listed]
    assert not missing, missing


@pytest.mark.parametrize("method", ["vit_progressive", "vit_dynamic_feature"])
def test_progressive_handover_ends_within_the_run(method):
    """Evaluation uses N2 (RepBN) alone, so the LN -> RepBN hand-over must end inside the run:
    SLAB hands over in 300,000 of ~375,000 ImageNet steps (models/prepbn.py:20, 80%). Kept at
    300,000 for the plain CIFAR configs (39,000 steps) it left N1 a weight of 0.87 at the end."""
    import importlib
    import math
    module = importlib.import_module(f"configs.{method}")
    for variant in (None, "cifar100", "small32"):
        c = module.get_config(variant)
        steps = c.total_steps or math.ceil(c.num_epochs * (50_000 // c.batch_size))
        n = c.model.norm
        assert n.warmup_steps + n.decay_steps == int(0.8 * steps), variant
    assert module.get_config("imagenet").model.norm.decay_steps == 300_000
    assert module.get_config("demo").model.norm.decay_steps == 700  # the measured demo


def test_progressive_handover_past_the_run_is_said_at_start():
    from normvit_jax.norms import progressive
    cfg = {"name": "progressive", "n1": "layernorm", "n2": "repbn", "decay_steps": 1000,
           "warmup_steps": 100}
    line = progressive.handover_note([{"name": "layernorm"}, cfg], 350)
    # linear: N1's weight at the last step = 1 - (350 - 100) / 1000
    assert "ends at step 1100" in line and "350 steps" in line and "0.75" in line
    assert "at most 250" in line
    assert progressive.handover_note([cfg], 1100) is None  # ends on the last step
    assert progressive.handover_note([dict(cfg, eval_mode="mixture")], 350) is None


def test_slab_dyt_derf_presets_carry_the_cited_values():
    """Against the sources configs/recipes.py cites (xinghaochen/SLAB classification/config.py,
    cfgs/deit_{t,s}_prepbn.yaml, models/deit.py, models/prepbn.py; jiachenzhu/DyT README.md and
    main.py; zlab-princeton/Derf ViT/README.md and ViT/main.py)."""
    spe = 1_281_167 // 1024
    for spec, variant in (("vit_repbn.py:slab_deit_t", "Ti/16"), ("vit_progressive.py:slab_deit_s", "S/16")):
        s = load(spec)
        assert (s.model.variant, s.batch_size, s.mix_groups, s.num_epochs) == (variant, 1024, 8, 300.0)
        # BASE_LR 5e-4 x 1024 / 512; MIN_LR 5e-6 scaled alike; WARMUP_EPOCHS 20; CLIP_GRAD 5.0
        assert (s.optimizer.learning_rate, s.optimizer.weight_decay, s.optimizer.grad_clip) == \
            (1e-3, 0.05, 5.0)
        assert s.schedule.end_factor == pytest.approx(0.01) and s.schedule.warmup_steps == 20 * spe
        # DROP_PATH_RATE 0.0 (yaml), no EMA in main.py, no repeated augmentation
        assert (s.model.stochastic_depth, s.ema_decay, s.data.repeated_aug) == (0.0, 0.0, 1)
        assert (s.label_smoothing, s.mixup_alpha, s.cutmix_alpha, s.random_erase_prob) == \
            (0.1, 0.8, 1.0, 0.25)
        assert (s.randaugment, s.data.interpolation, s.data.eval_crop_fraction) == \
            ("rand-m9-mstd0.5-inc1", "bicubic", 0.875)
    assert load("vit_repbn.py:slab_deit_t").model.norm.eta_init == 1.0  # prepbn.py:9 alpha = 1
    p = load("vit_progressive.py:slab_deit_s").model.norm  # prepbn.py:20 step=300000, warm=0
    assert (p.decay_steps, p.warmup_steps, p.r0, p.n1.epsilon) == (300_000, 0, 1.0, 1e-6)
    # DyT README.md: 8 nodes x 8 GPUs x 64, lr 4e-3, drop path 0.1 / 0.4, betas 0.9/0.95 for L,
    # EMA on; main.py: 300 epochs, 20 warm-up, min lr 1e-6, wd 0.05, timm global_pool='avg'
    # Derf ViT/README.md: B on 4 x 8 x 128 with main.py's drop path 0.15, L 8 x 8 x 64, 0.5
    spe = 1_281_167 // 4096
    for spec, groups, drop, b2 in (("vit_dyt.py:dyt_b", 64, 0.1, 0.999), ("vit_dyt.py:dyt_l", 64, 0.4, 0.95),
                                   ("vit_derf.py:dyt_b", 32, 0.15, 0.999),
                                   ("vit_derf.py:dyt_l", 64, 0.5, 0.95)):
        d = load(spec)
        assert (d.batch_size, d.mix_groups, d.model.stochastic_depth, d.optimizer.b2) == \
            (4096, groups, drop, b2), spec
        assert (d.optimizer.learning_rate, d.optimizer.weight_decay, d.optimizer.grad_clip) == \
            (4e-3, 0.05, None)
        assert d.schedule.warmup_steps == 20 * spe and d.schedule.end_factor == pytest.approx(1e-6 / 4e-3)
        assert (d.ema_decay, d.model.classifier, d.num_epochs) == (0.9999, "token_gap_fc_norm", 300.0)
        assert (d.model.norm.alpha_init, d.model.gelu_approximate) == (0.5, False)

"""Fine-tune a Google ImageNet-21k ViT (vit_jax or AugReg .npz) on CIFAR-10/100.

    python main.py --config=configs/finetune_cifar.py:b16 --workdir=runs/ft_b16
    python main.py --config=configs/finetune_cifar.py:l16,384,cifar100,accum8 --workdir=...
    python main.py --config=configs/finetune_cifar.py:b32,batchnorm --workdir=...   # LN weights into BN
    ... --config.init_from=/local/copy/ViT-B_16.npz                                 # no gs:// access

Variants (comma-separated): model b16 | b32 | l16 | l32 (default b16); resolution 224 (default) |
384; cifar10 (default) | cifar100; weights i21k (default: gs://vit_models/imagenet21k/ViT-*.npz) |
augreg (the AugReg i21k files big_vision recommends; none for L/32); any registered norm name
(layernorm default; other norms get LN's scale/bias where the names match, see docs/pretrained.md);
accum<N>: split each 512 batch into N micro-batches (same update; for small memory — except that
batch-statistic norms then see micro-batch statistics).

Recipe (vit_jax's fine-tuning defaults): SGD momentum 0.9, no weight decay, batch 512, lr 0.03,
500 linear warmup steps then cosine to 0, global-norm clip 1, 10k steps; train on train[:98%]
(vit_jax holds 2% out), Inception crop (area 0.05-1) + flip, resize to the resolution, [-1, 1]
inputs; no dropout, label smoothing or mixup; the i21k pre_logits layer is dropped and the head is
re-initialised to zeros for 10/100 classes.
"""
from __future__ import annotations

import ml_collections

from configs import default

I21K = "gs://vit_models/imagenet21k/ViT-{size}_{patch}.npz"
AUGREG = {  # big_vision's recommended AugReg i21k checkpoints (arXiv:2106.10270)
    "B/16": "gs://vit_models/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz",
    "B/32": "gs://vit_models/augreg/B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0.npz",
    "L/16": "gs://vit_models/augreg/L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0.npz",
}
MODELS = {"b16": "B/16", "b32": "B/32", "l16": "L/16", "l32": "L/32"}


def _norm_names() -> list[str]:
    from normvit_jax import norms  # the registry grows; read it when the config is built
    return norms.known_names()


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = default.get_config()
    parts = [p.strip().lower() for p in (arg or "").split(",") if p.strip()]
    variant, res, dataset, weights, accum = "B/16", 224, "cifar10", "i21k", 1
    norm = "layernorm"
    for p in parts:
        if p in MODELS:
            variant = MODELS[p]
        elif p in ("224", "384"):
            res = int(p)
        elif p in ("cifar10", "cifar100"):
            dataset = p
        elif p in ("i21k", "augreg"):
            weights = p
        elif p.startswith("accum") and p[5:].isdigit() and int(p[5:]) >= 1:
            accum = int(p[5:])
        elif p in _norm_names():
            norm = p
        else:
            raise ValueError(
                f"unknown fine-tuning variant {p!r} (configs/finetune.py and finetune_cifar.py; "
                f"neither has a demo); accepted: {sorted(MODELS)}, 224, 384, cifar10, "
                f"cifar100, i21k, augreg, accum<N>, or a norm name {_norm_names()}")
    if weights == "augreg" and variant not in AUGREG:
        raise ValueError(f"no AugReg i21k checkpoint for {variant}; accepted with augreg: {sorted(AUGREG)}")

    c.data.name = dataset
    c.data.train_split = "train[:98%]"
    c.data.eval_split = "test"
    c.data.image_size = res
    c.data.normalize = "minus_one_one"
    c.data.crop_padding = 0
    c.data.random_resized_crop = True
    c.data.min_crop_area = 0.05
    c.data.flip = True
    c.data.eval_crop_fraction = 1.0

    c.model.variant = variant
    c.model.classifier = "token"
    c.model.posemb = "learn"
    c.model.representation_size = None   # drop the i21k pre_logits (vit_jax's fine-tuning default)
    c.model.dropout_rate = 0.0
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.0
    c.model.gelu_approximate = True      # Google's checkpoints were trained with tanh GELU
    c.model.norm = ml_collections.ConfigDict(
        {"name": "layernorm", "epsilon": 1e-6} if norm == "layernorm" else {"name": norm})

    size, patch = variant.split("/")
    c.init_from = AUGREG[variant] if weights == "augreg" else I21K.format(size=size, patch=patch)
    c.init_keep_pre_logits = None        # None: follow model.representation_size (see pretrained.py)

    c.batch_size = 512
    c.eval_batch_size = 512
    c.grad_accum_steps = accum
    c.total_steps = 10_000
    c.optimizer.name = "sgd"
    c.optimizer.learning_rate = 0.03
    c.optimizer.momentum = 0.9
    c.optimizer.nesterov = False
    c.optimizer.weight_decay = 0.0
    c.optimizer.grad_clip = 1.0
    c.schedule.name = "cosine"
    c.schedule.warmup_steps = 500
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.0
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 1000
    return c

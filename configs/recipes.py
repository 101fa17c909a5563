"""Published training recipes, applied on top of a method's config by the presets in vit_*.py.

Every value carries its source. Abbreviations:
  [DeiT]   Touvron et al., "Training data-efficient image transformers", ICML 2021, and its
           repository's main.py defaults (facebookresearch/deit); the DTN paper trains with it.
  [BV]     big_vision configs/vit_s16_i1k.py ("Better plain ViT baselines for ImageNet-1k",
           Beyer et al. 2022) and big_vision/optax.py (how its wd is applied).
  [LS]     the LearnableScaler README's training command (timm train.py; /work/shared/seeds).
  [UN]     hikvision-research/Unified-Normalization, image_classification/: run_train.sh, main.py
           defaults (timm train.py of T2T-ViT, Yuan et al. ICCV 2021) and models/t2t_vit.py.
  [NORMS]  the project's /work/shared/NORMS.md summary of each reference.
Values a source does not give stay at configs/default.py's and are named in the README table.
"""
from __future__ import annotations

import ml_collections

WIDTH = {"Ti": 192, "S": 384, "B": 768, "L": 1024, "H": 1280}  # ViT widths (Dosovitskiy et al.)
IMAGENET_TRAIN_EXAMPLES = 1_281_167  # tfds imagenet2012 'train'
# RandAugment policies (config key ``randaugment``; train/randaugment.py parses them).
RANDAUGMENT_DEIT = "rand-m9-mstd0.5-inc1"  # [DeiT] --aa default
RANDAUGMENT_BIGVISION = "bigvision-2-10"    # [BV] pp_train: randaug(2, 10)
RANDAUGMENT_LS = "rand-m7-mstd0.5"         # [LS] --aa


def set_randaugment(c: ml_collections.ConfigDict, policy: str) -> None:
    """The RandAugment policy (config key ``randaugment``, parsed by train/randaugment.py)."""
    c.randaugment = policy


def steps_per_epoch(batch_size: int, num_examples: int = IMAGENET_TRAIN_EXAMPLES) -> int:
    return num_examples // batch_size  # the pipeline drops the last partial batch


def imagenet_data(c: ml_collections.ConfigDict, normalize: str, antialias: bool,
                  interpolation: str) -> None:
    """ImageNet-1k at 224: Inception crop + flip for training, resize 256 / central 224 for eval."""
    c.data.name = "imagenet2012"
    c.data.train_split = "train"
    c.data.eval_split = "validation"
    c.data.image_size = 224
    c.data.crop_padding = 0
    c.data.random_resized_crop = True   # [DeiT] RandomResizedCrop(0.08-1); [BV] inception_crop
    c.data.min_crop_area = 0.08
    c.data.flip = True
    c.data.eval_crop_fraction = 0.875   # [DeiT] crop_pct 224/256; [BV] resize_small(256)|central_crop(224)
    c.data.normalize = normalize
    c.data.antialias = antialias        # [DeiT] PIL resize (antialiased); [BV] tf.image.resize (not)
    c.data.interpolation = interpolation  # [DeiT] bicubic; [BV] bilinear; [LS], [UN] random


def deit(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """DeiT's ImageNet-1k recipe (no distillation), 300 epochs at batch 1024 [DeiT]."""
    imagenet_data(c, "zscore", True, "bicubic")  # [DeiT] IMAGENET_DEFAULT_MEAN/STD;
                                        # --train-interpolation bicubic, eval Resize(interpolation=3)
    c.model.variant = variant
    c.model.classifier = "token"        # [DeiT] class token
    c.model.posemb = "learn"
    c.model.dropout_rate = 0.0          # [DeiT] --drop 0
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.1      # [DeiT] --drop-path 0.1
    c.model.gelu_approximate = False    # [DeiT] timm's exact GELU
    c.model.param_init = "timm"         # [DeiT] timm's _init_weights: trunc_normal_(std=.02)
    c.batch_size = 1024                 # [DeiT] 1024 (8 GPUs x 128) [NORMS]
    c.num_epochs = 300.0                # [DeiT] --epochs 300
    c.total_steps = None
    c.optimizer.name = "adamw"          # [DeiT] --opt adamw
    c.optimizer.learning_rate = 5e-4 * c.batch_size / 512  # [DeiT] lr 5e-4 x batch / 512
    c.optimizer.weight_decay = 0.05     # [DeiT] --weight-decay 0.05
    c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999
    c.optimizer.grad_clip = None        # [DeiT] --clip-grad None
    c.schedule.name = "cosine"          # [DeiT] --sched cosine
    c.schedule.warmup_steps = 5 * steps_per_epoch(c.batch_size)  # [DeiT] --warmup-epochs 5
    c.schedule.end_factor = 1e-5 / c.optimizer.learning_rate     # [DeiT] --min-lr 1e-5
    c.label_smoothing = 0.1             # [DeiT] --smoothing 0.1
    c.mixup_alpha = 0.8                 # [DeiT] --mixup 0.8
    c.cutmix_alpha = 1.0                # [DeiT] --cutmix 1.0
    c.mix_prob = 1.0                    # [DeiT] --mixup-prob 1.0
    c.switch_prob = 0.5                 # [DeiT] --mixup-switch-prob 0.5
    c.mix_mode = "batch"                # [DeiT] --mixup-mode batch
    c.random_erase_prob = 0.25          # [DeiT] --reprob 0.25
    c.random_erase_mode = "pixel"       # [DeiT] --remode pixel
    c.data.repeated_aug = 3             # [DeiT] --repeated-aug (3 repeats)
    c.ema_decay = 0.99996               # [DeiT] --model-ema-decay 0.99996
    set_randaugment(c, RANDAUGMENT_DEIT)
    c.dtype = "bfloat16"                # [DeiT] mixed precision (AMP); bf16 here
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 2000
    return c


def bigvision_i1k(c: ml_collections.ConfigDict, variant: str = "S/16",
                  epochs: float = 90.0) -> ml_collections.ConfigDict:
    """big_vision's plain-ViT ImageNet-1k recipe [BV]: 76.5% for S/16 after 90 epochs."""
    imagenet_data(c, "minus_one_one", False, "bilinear")  # [BV] value_range(-1, 1), tf bilinear
    c.data.train_split = "train[:99%]"  # [BV] train_split (1% held out as minival)
    c.model.variant = variant           # [BV] variant='S/16'
    c.model.classifier = "gap"          # [BV] pool_type='gap'
    c.model.posemb = "sincos2d"         # [BV] posemb='sincos2d'
    c.model.representation_size = WIDTH[variant.split("/")[0]]  # [BV] rep_size=True: a pre_logits
                                        # Dense(tanh) of the model width before the head
    c.model.dropout_rate = 0.0          # [BV] no dropout or stochastic depth
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.0
    c.model.gelu_approximate = True     # flax nn.gelu's default, as big_vision's ViT
    c.model.param_init = "google"       # [BV] big_vision's ViT initialisation
    c.batch_size = 1024                 # [BV] batch_size
    c.num_epochs = float(epochs)        # [BV] num_epochs 90
    c.total_steps = None
    c.optimizer.name = "adamw"          # [BV] scale_by_adam + decoupled wd
    c.optimizer.learning_rate = 1e-3    # [BV] lr 0.001
    # [BV] wd 0.0001 is added after the lr scaling (big_vision/optax.py: not multiplied by lr,
    # only by the schedule); optax.adamw multiplies weight_decay by the lr: 1e-4 / 1e-3.
    c.optimizer.weight_decay = 1e-4 / 1e-3
    c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999  # optax.scale_by_adam defaults
    c.optimizer.grad_clip = 1.0         # [BV] grad_clip_norm 1.0
    c.schedule.name = "cosine"          # [BV] decay_type='cosine'
    c.schedule.warmup_steps = 10_000    # [BV] warmup_steps=10_000
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.0             # [BV] plain softmax_xent
    c.mixup_alpha = 0.2                 # [BV] mixup p=0.2 (Beta(0.2, 0.2))
    c.cutmix_alpha = 0.0
    c.random_erase_prob = 0.0
    c.data.repeated_aug = 1
    c.ema_decay = 0.0
    set_randaugment(c, RANDAUGMENT_BIGVISION)
    c.dtype = "bfloat16"                # TPU bf16 activations
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 50, 2500, 1000  # [BV] log 50, eval 2500, ckpt 1000
    return c


def learnable_scaler_paper(c: ml_collections.ConfigDict, depth: int = 24,
                           width: int = 192, patch: int = 16) -> ml_collections.ConfigDict:
    """The LearnableScaler README's ImageNet-1k command [LS] for vit(patch, width, depth)."""
    # [LS] timm defaults: ImageNet mean/std, crop_pct 0.875, --train-interpolation 'random'
    # (bilinear or bicubic per image), eval bicubic (the ViT's cfg; 'random' evaluates bicubic)
    imagenet_data(c, "zscore", True, "random")
    c.model.variant = None
    c.model.patch_size = patch          # [LS] vit(16, 192, 24)
    c.model.hidden_size = width
    c.model.depth = depth
    c.model.num_heads = width // 64     # not given by [LS]: 64-wide heads as ViT-Ti (192/3)
    c.model.mlp_dim = 4 * width
    c.model.classifier = "token"
    c.model.stochastic_depth = 0.0      # [LS] no --drop-path (timm default 0)
    c.model.gelu_approximate = False    # timm's exact GELU
    c.model.param_init = "timm"         # [LS] timm's VisionTransformer init
    c.batch_size = 2048                 # [LS] --batch-size 256 x --grad-accum-steps 8
    c.grad_accum_steps = 8              # [LS] --grad-accum-steps 8 (micro-batches of 256)
    c.num_epochs = 300.0                # [LS] --epochs 300
    c.total_steps = None
    c.optimizer.name = "lamb"           # [LS] --opt lamb
    c.optimizer.learning_rate = 5e-3    # [LS] --lr 0.005
    c.optimizer.weight_decay = 0.02     # [LS] --weight-decay 0.02
    c.optimizer.grad_clip = 14.0        # [LS] --clip-grad 14
    c.schedule.name = "cosine"          # [LS] uses --sched custom (not reproduced; see README)
    c.schedule.warmup_steps = 0         # [LS] --warmup-epoch 0
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.1             # [LS] timm's --smoothing default 0.1
    c.mixup_alpha = 0.1                 # [LS] --mixup 0.1
    c.cutmix_alpha = 1.0                # [LS] --cutmix 1
    c.mix_prob, c.switch_prob, c.mix_mode = 1.0, 0.5, "batch"  # timm defaults
    c.random_erase_prob = 0.0           # [LS] no --reprob (timm default 0)
    c.data.repeated_aug = 1
    c.ema_decay = 0.0                   # [LS] no --model-ema
    set_randaugment(c, RANDAUGMENT_LS)
    c.dtype = "bfloat16"                # [LS] --amp --amp-dtype bfloat16
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 2000
    return c


def t2t_vit(c: ml_collections.ConfigDict, variant: str = "T2T-14") -> ml_collections.ConfigDict:
    """UN's ImageNet-1k run of T2T-ViT-14 [UN] (T2T-ViT's own recipe): 300 epochs at batch 512."""
    # [UN] timm: ImageNet mean/std, PIL resize, --train-interpolation 'random' (bilinear or
    # bicubic per image), eval bicubic (t2t_vit.py _cfg; 'random' evaluates bicubic)
    imagenet_data(c, "zscore", True, "random")
    c.data.eval_crop_fraction = 0.9     # [UN] t2t_vit.py _cfg crop_pct 0.9
    c.model.name = "t2t_vit"            # [UN] T2t_vit_14: tokens_type='performer'
    c.model.variant = variant           # [UN] embed 384, depth 14, heads 6, mlp_ratio 3
    c.model.patch_size = 16             # three soft splits, strides 4 x 2 x 2
    c.model.token_dim = 64              # [UN] T2T_module token_dim=64
    c.model.kernel_ratio = 0.5          # [UN] Token_performer kernel_ratio=0.5
    c.model.t2t_dropout_rate = 0.1      # [UN] Token_performer dp1 = dp2 = 0.1
    # The stem's four norm slots: name None = model.norm (UN's all_un1d); e.g. 'layernorm' + options
    c.model.stem_norm = ml_collections.ConfigDict({"name": ml_collections.config_dict.placeholder(str)})
    c.model.classifier = "token"        # [UN] cls_token, head on x[:, 0]
    c.model.posemb = "sincos1d"         # [UN] get_sinusoid_encoding(num_patches + 1), not trained
    c.model.qkv_bias = False            # [UN] T2T_ViT qkv_bias=False
    if c.model.norm.name == "layernorm":
        c.model.norm.epsilon = 1e-5     # [UN] torch nn.LayerNorm default (the LN baseline)
    c.model.gelu_approximate = False    # [UN] nn.GELU (exact)
    c.model.param_init = "timm"         # [UN] T2T_ViT._init_weights: trunc_normal_(std=.02)
    c.model.dropout_rate = 0.0          # [UN] --drop 0
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.1      # [UN] --drop-path 0.1
    c.batch_size = 512                  # [UN] run_train.sh: 8 GPUs x --batch-size 64
    c.num_epochs = 300.0                # [UN] --epochs 300 (+10 cooldown epochs at min-lr not run here)
    c.total_steps = None
    c.optimizer.name = "adamw"          # [UN] --opt adamw
    c.optimizer.learning_rate = 5e-4    # [UN] --lr 5e-4 (not rescaled by batch size)
    c.optimizer.weight_decay = 0.05     # [UN] --weight-decay 0.05
    c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999
    c.optimizer.grad_clip = None        # [UN] --clip-grad None
    c.schedule.name = "cosine"          # [UN] --sched cosine
    c.schedule.warmup_steps = 10 * steps_per_epoch(c.batch_size)  # [UN] --warmup-epochs 10
    c.schedule.end_factor = 1e-5 / c.optimizer.learning_rate      # [UN] --min-lr 1e-5
    c.label_smoothing = 0.1             # [UN] --smoothing 0.1
    c.mixup_alpha = 0.8                 # [UN] --mixup 0.8
    c.cutmix_alpha = 1.0                # [UN] --cutmix 1.0
    c.mix_prob = 1.0                    # [UN] --mixup-prob 1.0
    c.switch_prob = 0.5                 # [UN] --mixup-switch-prob 0.5
    c.mix_mode = "batch"                # [UN] --mixup-mode batch
    c.random_erase_prob = 0.25          # [UN] --reprob 0.25
    c.random_erase_mode = "pixel"       # [UN] --remode pixel
    c.data.repeated_aug = 1             # [UN] no repeated augmentation (timm train.py)
    c.ema_decay = 0.99996               # [UN] --model-ema (on by default) decay 0.99996
    set_randaugment(c, RANDAUGMENT_DEIT)  # [UN] --aa rand-m9-mstd0.5-inc1
    c.dtype = "bfloat16"                # [UN] apex/native AMP; bf16 here
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 2000
    return c


def rescale_cifar10_b16(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """RescaleViT's CIFAR-10 from-scratch run: ViT-B/16 at 224, 20k steps of batch 128 [NORMS],
    on top of jeonsworld/ViT-pytorch (the code RescaleViT extends) for what [NORMS] does not say."""
    c.data.name = "cifar10"
    c.data.train_split = "train"
    c.data.eval_split = "test"
    c.data.image_size = 224             # RescaleViT README: resolution 224x224
    c.data.crop_padding = 0
    c.data.random_resized_crop = True   # ViT-pytorch: RandomResizedCrop(224, scale=(0.05, 1))
    c.data.min_crop_area = 0.05
    c.data.flip = False                 # ViT-pytorch's CIFAR transform has no flip
    c.data.eval_crop_fraction = 1.0     # ViT-pytorch: Resize(224) for test
    c.data.normalize = "minus_one_one"  # ViT-pytorch: Normalize(0.5, 0.5)
    c.model.variant = "B/16"            # RescaleViT README: ViT-B_16
    c.batch_size = 128                  # RescaleViT README: batch size 128
    c.total_steps = 20_000              # RescaleViT README: 20000 iterations
    c.optimizer.name = "sgd"            # [NORMS] SGD momentum 0.9
    c.optimizer.momentum = 0.9
    c.optimizer.nesterov = False
    c.optimizer.learning_rate = 0.05    # [NORMS] lr 0.05
    c.optimizer.weight_decay = 0.0      # [NORMS] wd 0
    c.optimizer.grad_clip = 1.0         # ViT-pytorch --max_grad_norm 1.0
    c.schedule.name = "cosine"          # [NORMS] cosine with 500 warmup steps
    c.schedule.warmup_steps = 500
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.0
    c.model.stochastic_depth = 0.0
    c.dtype = "float32"                 # the README's run used apex O2 fp16; bf16 is an option
    c.eval_batch_size = 512
    c.log_every, c.eval_every, c.checkpoint_every = 100, 100, 1000  # README: --eval_every 100
    return c


# Presets shared by the method configs: name -> function of the config.
DEIT = {
    # DTN paper's ViT-T* (4 heads of 48), ViT-S, ViT-B* (16 heads of 48) [NORMS]
    "deit_t": lambda c: _heads(deit(c, "Ti/16"), 4),
    "deit_s": lambda c: deit(c, "S/16"),
    "deit_b": lambda c: _heads(deit(c, "B/16"), 16),
}
T2T = {"t2t_vit_14": lambda c: t2t_vit(c, "T2T-14")}  # UN's setting [UN]
BIGVISION = {
    "bigvision_s16_90ep": lambda c: bigvision_i1k(c, "S/16", 90.0),
    "bigvision_s16_300ep": lambda c: bigvision_i1k(c, "S/16", 300.0),  # [BV] "--config.num_epochs 300"
}


def _heads(c: ml_collections.ConfigDict, n: int) -> ml_collections.ConfigDict:
    c.model.num_heads = n
    return c

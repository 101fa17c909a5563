"""Published training recipes, applied on top of a method's config by the presets in vit_*.py.

Every value carries its public source: repository @ commit, file:line (a command-line default
unless said), or paper + table. Abbreviations:
  [DeiT] facebookresearch/deit @7e160fe main.py (argument defaults) and README_deit.md (training
         commands: ViT-Ti/S on 4 GPUs x --batch-size 256; ViT-B with run_with_submitit.py on 2 nodes
         x 8 GPUs at main.py's --batch-size 64; timm 0.3.2 pinned). Touvron et al., ICML 2021.
  [DTN]  Shao et al., "Dynamic Token Normalization Improves Vision Transformers", ICLR 2022: trains
         with DeiT's recipe (the paper's setup); the presets follow the paper, not its released code.
  [BV]   google-research/big_vision @0127fb6 big_vision/configs/vit_s16_i1k.py ("Better plain ViT
         baselines for ImageNet-1k", Beyer et al. 2022), big_vision/pp/ops_image.py, big_vision/optax.py.
  [LS]   nghiemtuan/LearnableScaler @1750860: README.md's training command, train.py, and its timm
         fork (timm/version.py 0.8.21dev0; timm/models/vision_transformer.py, timm/optim/lamb.py).
  [UN]   hikvision-research/Unified-Normalization @0ce9bf2 image_classification/: run_train.sh,
         main.py (timm train.py of T2T-ViT, Yuan et al. ICCV 2021), models/t2t_vit.py.
  [DTNc] wqshao126/DTN @f6b4337: the released training code (train.py, configs/ViT/vit.yaml,
         scripts/train.sh, models/vit_norm.py), which differs from the paper's recipe (``dtn_code``).
  [RV]   ChaofanTao/RescaleViT @3a761cc: README.md, train.py, train1.sh, models/configs.py,
         utils/data_utils.py (on top of jeonsworld/ViT-pytorch).
Values a source does not give stay at configs/default.py's and are named in docs/recipes.md.
"""
from __future__ import annotations

import ml_collections

WIDTH = {"Ti": 192, "S": 384, "B": 768, "L": 1024, "H": 1280}  # ViT widths (Dosovitskiy et al.)
IMAGENET_TRAIN_EXAMPLES = 1_281_167  # tfds imagenet2012 'train'
# RandAugment policies (config key ``randaugment``; train/randaugment.py parses them).
RANDAUGMENT_DEIT = "rand-m9-mstd0.5-inc1"  # [DeiT] main.py:98 --aa; [UN] main.py:141
RANDAUGMENT_BIGVISION = "bigvision-2-10"    # [BV] vit_s16_i1k.py:57 randaug(2,10)
RANDAUGMENT_LS = "rand-m7-mstd0.5"         # [LS] README.md command --aa


def set_randaugment(c: ml_collections.ConfigDict, policy: str) -> None:
    """The RandAugment policy (config key ``randaugment``, parsed by train/randaugment.py)."""
    c.randaugment = policy


def steps_per_epoch(batch_size: int, num_examples: int = IMAGENET_TRAIN_EXAMPLES) -> int:
    return num_examples // batch_size  # the pipeline drops the last partial batch


def per_process_statistics(c: ml_collections.ConfigDict, samples: int) -> None:
    """Batch-statistics norms (BatchNorm, RepBN, UN, PowerNorm; a progressive norm's N2) take
    their statistics over each GPU process's ``samples`` images, as the PyTorch references do:
    none of them converts to SyncBatchNorm ([DeiT] main.py, [UN] main.py:189 --sync-bn off,
    [SLAB] main.py, [DTNc] train.py). Other norms have no such key and are left alone."""
    norm = c.model.norm
    for n in (norm, norm.get("n2") if norm.get("name") == "progressive" else None):
        if not isinstance(n, ml_collections.ConfigDict):
            continue
        if "stats_group_size" in n or n.get("name") in ("batchnorm", "repbn", "unified", "powernorm"):
            n.stats_group_size = samples


def imagenet_data(c: ml_collections.ConfigDict, normalize: str, antialias: bool,
                  interpolation: str, eval_crop: float = 0.875,
                  min_crop_area: float = 0.08) -> None:
    """ImageNet-1k at 224: Inception crop + flip for training, central crop + resize for eval."""
    c.data.name = "imagenet2012"
    c.data.train_split = "train"
    c.data.eval_split = "validation"
    c.data.image_size = 224
    c.data.crop_padding = 0
    c.data.random_resized_crop = True   # timm RandomResizedCrop(scale=(0.08, 1)); [BV] inception_crop
    c.data.min_crop_area = min_crop_area
    c.data.flip = True
    c.data.eval_crop_fraction = eval_crop  # timm: Resize(224 / crop_pct) + CenterCrop(224)
    c.data.normalize = normalize
    c.data.antialias = antialias        # timm: PIL resize (antialiased); [BV] tf.image.resize (not)
    c.data.interpolation = interpolation


def timm_deit_training(c: ml_collections.ConfigDict, *, batch: int, lr: float, warmup_epochs: int,
                       mix_groups: int) -> ml_collections.ConfigDict:
    """The training values DeiT's main.py and T2T-ViT's timm train.py (UN's) share, each cited
    there as [DeiT] main.py:N / [UN] main.py:M. Both draw Mixup/CutMix per GPU process with timm
    before 1.0.29 (``mix_groups`` processes; CutMix's 'even' box)."""
    c.model.classifier = "token"        # class token, head on x[:, 0]
    c.model.dropout_rate = 0.0          # [DeiT] main.py:44 --drop 0; [UN] main.py:173
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.1      # [DeiT] main.py:46 --drop-path 0.1; [UN] main.py:177
    c.model.gelu_approximate = False    # timm's nn.GELU (exact)
    c.model.param_init = "timm"         # trunc_normal_(std=.02) on every Linear and the class token
    c.batch_size = batch
    c.num_epochs = 300.0                # [DeiT] main.py:35 --epochs 300; [UN] main.py:113
    c.total_steps = None
    c.optimizer.name = "adamw"          # [DeiT] main.py:56 --opt adamw; [UN] main.py:81
    c.optimizer.learning_rate = lr
    c.optimizer.weight_decay = 0.05     # [DeiT] main.py:66 --weight-decay 0.05; [UN] main.py:89
    c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999  # --opt-betas None: torch AdamW's defaults
    c.optimizer.grad_clip = None        # [DeiT] main.py:62 --clip-grad None; [UN] main.py:91
    c.schedule.name = "cosine"          # [DeiT] main.py:69 --sched cosine; [UN] main.py:95
    c.schedule.warmup_steps = warmup_epochs * steps_per_epoch(batch)
    c.schedule.end_factor = 1e-5 / lr   # [DeiT] main.py:81 --min-lr 1e-5; [UN] main.py:111
    c.label_smoothing = 0.1             # [DeiT] main.py:101 --smoothing 0.1; [UN] main.py:169
    c.mixup_alpha = 0.8                 # [DeiT] main.py:128 --mixup 0.8; [UN] main.py:155
    c.cutmix_alpha = 1.0                # [DeiT] main.py:130 --cutmix 1.0; [UN] main.py:157
    c.mix_prob = 1.0                    # [DeiT] main.py:134 --mixup-prob 1.0; [UN] main.py:161
    c.switch_prob = 0.5                 # [DeiT] main.py:136 --mixup-switch-prob 0.5; [UN] main.py:163
    c.mix_mode = "batch"                # [DeiT] main.py:138 --mixup-mode batch; [UN] main.py:165
    c.mix_groups = mix_groups           # one Mixup draw per GPU process's batch
    per_process_statistics(c, batch // mix_groups)  # and per-GPU BatchNorm-style statistics
    c.cutmix_box = "even"               # timm 0.3.x rand_bbox: c +- cut // 2
    c.random_erase_prob = 0.25          # [DeiT] main.py:118 --reprob 0.25; [UN] main.py:147
    c.random_erase_mode = "pixel"       # [DeiT] main.py:120 --remode pixel; [UN] main.py:149
    c.ema_decay = 0.99996               # [DeiT] main.py:51-52 model EMA on, 0.99996; [UN] main.py:197-201
    set_randaugment(c, RANDAUGMENT_DEIT)
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 2000
    return c


def deit(c: ml_collections.ConfigDict, variant: str, gpus: int = 4) -> ml_collections.ConfigDict:
    """DeiT's ImageNet-1k recipe (no distillation), 300 epochs at batch 1024 [DeiT]: ViT-Ti/S as
    README_deit.md's 4 GPUs x 256, ViT-B (``gpus=16``) as its 2 nodes x 8 GPUs x 64."""
    # [DeiT] IMAGENET_DEFAULT_MEAN/STD; main.py:102 --train-interpolation bicubic; datasets.py:101-103
    # eval Resize(224 / 0.875, bicubic) + CenterCrop(224) (main.py:174 --eval-crop-ratio 0.875)
    imagenet_data(c, "zscore", True, "bicubic")
    c.model.variant = variant
    c.model.posemb = "learn"
    # [DeiT] main.py:34 --batch-size per GPU x world size: 4 x 256 = 16 x 64 = 1024;
    # main.py:349-351 lr 5e-4 x 1024 / 512; main.py:86 --warmup-epochs 5. No cooldown: main.py:420
    # trains exactly --epochs (create_scheduler's extra 10 cooldown epochs are not run).
    timm_deit_training(c, batch=1024, lr=5e-4 * 1024 / 512, warmup_epochs=5, mix_groups=gpus)
    c.data.repeated_aug = 3             # [DeiT] main.py:105-107 repeated augmentation on (3 repeats)
    c.dtype = "bfloat16"                # [DeiT] torch AMP (fp16) by default; bf16 here
    return c


def dtn_released_code(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """After a ``deit_*`` preset: what DTN's released code [DTNc] trains with where it differs from
    the paper's DeiT recipe (``vit_dtn.py:deit_s,dtn_code``)."""
    c.batch_size = 256                  # [DTNc] scripts/train.sh: NUM_PROC=2 x --batch-size 128
    lr = 5e-4 * c.batch_size / 512      # [DTNc] vit.yaml:1 lr 5e-4; train.py:342-343 x batch / 512
    c.optimizer.learning_rate = lr
    c.schedule.warmup_steps = 5 * steps_per_epoch(c.batch_size)  # [DTNc] train.py:127
    c.schedule.end_factor = 1e-5 / lr   # [DTNc] train.py:119 --min-lr 1e-5
    c.mixup_alpha = c.cutmix_alpha = 0.0  # [DTNc] train.py:404: mixup_fn = None, never applied
    c.mix_groups = 1
    per_process_statistics(c, 128)      # [DTNc] scripts/train.sh: 128 images per process
    c.random_erase_prob = 0.0           # [DTNc] train.py:155 --reprob 0
    c.model.qkv_bias = False            # [DTNc] models/vit_norm.py:134 qkv_bias=False
    c.dtype = "float32"                 # [DTNc] vit.yaml:4 amp: False
    return c


def bigvision_i1k(c: ml_collections.ConfigDict, variant: str = "S/16",
                  epochs: float = 90.0) -> ml_collections.ConfigDict:
    """big_vision's plain-ViT ImageNet-1k recipe [BV]: 76.5% for S/16 after 90 epochs."""
    # [BV] vit_s16_i1k.py:51-57 value_range(-1, 1), decode_jpeg_and_inception_crop(224): ops_image.py
    # get_inception_crop area_min=5 (5% of the area), tf bilinear without antialias
    imagenet_data(c, "minus_one_one", False, "bilinear", min_crop_area=0.05)
    # [BV] vit_s16_i1k.py:60 eval resize_small(256) | central_crop(224): ops_image.py:106-131
    # get_resize_small method 'area' (sides rounded, result truncated to uint8), :268-292
    c.data.eval_resize_small = 256
    c.data.train_split = "train[:99%]"  # [BV] vit_s16_i1k.py:45 (1% held out as minival)
    c.model.variant = variant           # [BV] vit_s16_i1k.py:71 variant='S/16'
    c.model.classifier = "gap"          # [BV] vit_s16_i1k.py:73 pool_type='gap'
    c.model.posemb = "sincos2d"         # [BV] vit_s16_i1k.py:74 posemb='sincos2d'
    c.model.representation_size = WIDTH[variant.split("/")[0]]  # [BV] vit_s16_i1k.py:72 rep_size=True:
                                        # a pre_logits Dense(tanh) of the model width before the head
    c.model.dropout_rate = 0.0          # [BV] no dropout or stochastic depth in the config
    c.model.attention_dropout_rate = 0.0
    c.model.stochastic_depth = 0.0
    c.model.gelu_approximate = True     # flax nn.gelu's default, as big_vision's ViT
    c.model.param_init = "google"       # [BV] big_vision's ViT initialisation
    c.batch_size = 1024                 # [BV] vit_s16_i1k.py:47 input.batch_size
    c.num_epochs = float(epochs)        # [BV] vit_s16_i1k.py:38 total_epochs 90 (:27 300)
    c.total_steps = None
    c.optimizer.name = "adamw"          # [BV] scale_by_adam + decoupled wd
    c.optimizer.learning_rate = 1e-3    # [BV] vit_s16_i1k.py:82 lr 0.001
    # [BV] vit_s16_i1k.py:83 wd 0.0001 is added after the lr scaling (big_vision/optax.py: not
    # multiplied by lr, only by the schedule); optax.adamw multiplies weight_decay by the lr.
    c.optimizer.weight_decay = 1e-4 / 1e-3
    c.optimizer.b1, c.optimizer.b2 = 0.9, 0.999  # optax.scale_by_adam defaults
    c.optimizer.grad_clip = 1.0         # [BV] vit_s16_i1k.py:78 grad_clip_norm 1.0
    c.schedule.name = "cosine"          # [BV] vit_s16_i1k.py:84 decay_type='cosine'
    c.schedule.warmup_steps = 10_000    # [BV] vit_s16_i1k.py:84 warmup_steps=10_000
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.0             # [BV] plain softmax_xent
    c.mixup_alpha = 0.2                 # [BV] vit_s16_i1k.py:86 mixup p=0.2 (Beta(0.2, 0.2))
    c.cutmix_alpha = 0.0
    c.random_erase_prob = 0.0
    c.data.repeated_aug = 1
    c.ema_decay = 0.0
    set_randaugment(c, RANDAUGMENT_BIGVISION)
    c.dtype = "bfloat16"                # TPU bf16 activations
    c.eval_batch_size = 1024
    # [BV] vit_s16_i1k.py:65 log_training_steps 50, :95 eval log_steps 2500, :66 ckpt_steps 1000
    c.log_every, c.eval_every, c.checkpoint_every = 50, 2500, 1000
    return c


def learnable_scaler_paper(c: ml_collections.ConfigDict, depth: int = 24,
                           width: int = 192, patch: int = 16) -> ml_collections.ConfigDict:
    """The LearnableScaler README's ImageNet-1k command [LS] for vit(patch, width, depth). There is
    no paper: the released code is the source."""
    # [LS] vision_transformer.py:1104-1112 _cfg of its 'vit_tiny_patch16_224' base: mean/std 0.5
    # (IMAGENET_INCEPTION_*), crop_pct 0.9, bicubic eval; train.py timm default --train-interpolation
    # 'random' (bilinear or bicubic per image; 'random' evaluates bicubic)
    imagenet_data(c, "minus_one_one", True, "random", eval_crop=0.9)
    c.model.variant = None
    c.model.patch_size = patch          # [LS] vision_transformer.py:1686-1711 vit_learnable_scaler_
    c.model.hidden_size = width         # embed_dim192_patch16_head3_depth24 / _depth36: 3 heads
    c.model.depth = depth
    c.model.num_heads = 3
    c.model.mlp_dim = 4 * width
    c.model.classifier = "token"
    c.model.stochastic_depth = 0.0      # [LS] no --drop-path (timm default 0)
    c.model.gelu_approximate = False    # timm's exact GELU
    c.model.param_init = "timm"         # [LS] timm's VisionTransformer init
    c.batch_size = 2048                 # [LS] --batch-size 256 x --grad-accum-steps 8 (one GPU)
    c.grad_accum_steps = 8              # [LS] --grad-accum-steps 8 (micro-batches of 256)
    c.num_epochs = 300.0                # [LS] --epochs 300
    c.total_steps = None
    c.optimizer.name = "lamb"           # [LS] --opt lamb: timm/optim/lamb.py (train/optimizer.py timm_lamb)
    c.optimizer.lamb_grad_clip = 1.0    # [LS] lamb.py Lamb(max_grad_norm=1.0), inside the optimizer
    c.optimizer.learning_rate = 5e-3    # [LS] --lr 0.005
    c.optimizer.weight_decay = 0.02     # [LS] --weight-decay 0.02
    c.optimizer.grad_clip = 14.0        # [LS] --clip-grad 14 (before the optimizer's own clip)
    c.schedule.name = "ls_custom"       # [LS] --sched custom: train.py:386-399 custom_lr_scheduler,
    c.schedule.epoch_factor = 0.8       # [LS] --epoch-factor 0.8
    c.schedule.epoch_threshold = 0.5    # [LS] --epoch-threshold 0.5
    c.schedule.final_fraction = 0.66    # [LS] train.py:390 int(num_epochs * 0.66)
    c.schedule.warmup_steps = 0         # [LS] --warmup-epoch 0
    c.label_smoothing = 0.1             # [LS] timm's --smoothing default 0.1
    c.mixup_alpha = 0.1                 # [LS] --mixup 0.1
    c.cutmix_alpha = 1.0                # [LS] --cutmix 1
    c.mix_prob, c.switch_prob, c.mix_mode = 1.0, 0.5, "batch"  # timm defaults
    c.mix_groups = 8                    # one draw per loader batch of 256 (train.py:938-940)
    c.cutmix_box = "even"               # its timm 0.8.21dev0 (timm/data/mixup.py:47-50)
    c.random_erase_prob = 0.0           # [LS] no --reprob (timm default 0)
    c.data.repeated_aug = 1
    c.ema_decay = 0.0                   # [LS] no --model-ema
    # [LS] README.md:86 --train-feature-decay 0.1 --attn-extra-loss 0.03 --attn-extra-loss-layers 6;
    # vision_transformer.py:229-263 (Block), :85-91 (Attention.compute_extra_loss), train.py:954
    # (the block sum times feature_decay again): train/aux_losses.py
    c.feature_decay = 0.1
    c.feature_decay_threshold = 200.0   # [LS] vision_transformer.py:231, hard-coded
    c.attn_extra_loss = 0.03
    c.attn_extra_loss_layers = 6
    set_randaugment(c, RANDAUGMENT_LS)
    c.dtype = "bfloat16"                # [LS] --amp --amp-dtype bfloat16
    c.eval_batch_size = 1024
    c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 2000
    return c


def t2t_vit(c: ml_collections.ConfigDict, variant: str = "T2T-14") -> ml_collections.ConfigDict:
    """UN's ImageNet-1k run of T2T-ViT-14 [UN] (T2T-ViT's own recipe): 300 epochs at batch 512.
    Follows the released code (fp32: main.py:217-221 no AMP flag on by default, and run_train.sh
    passes none); ``--config.dtype=bfloat16`` for mixed precision."""
    # [UN] timm: ImageNet mean/std, PIL resize, main.py:171 --train-interpolation 'random' (bilinear
    # or bicubic per image), eval bicubic at crop_pct 0.9 (models/t2t_vit.py:27 _cfg)
    imagenet_data(c, "zscore", True, "random", eval_crop=0.9)
    c.model.name = "t2t_vit"            # [UN] run_train.sh --model T2t_vit_14_all_un1d
    c.model.variant = variant           # [UN] embed 384, depth 14, heads 6, mlp_ratio 3
    c.model.patch_size = 16             # three soft splits, strides 4 x 2 x 2
    c.model.token_dim = 64              # [UN] models/t2t_vit.py:51 T2T_module token_dim=64
    c.model.kernel_ratio = 0.5          # [UN] models/t2t_vit.py:72-73 Token_performer kernel_ratio=0.5
    c.model.t2t_dropout_rate = 0.1      # [UN] models/token_performer.py:9 Token_performer dp1 = dp2 = 0.1
    # The stem's four norm slots: name None = model.norm (UN's all_un1d); e.g. 'layernorm' + options
    c.model.stem_norm = ml_collections.ConfigDict({"name": ml_collections.config_dict.placeholder(str)})
    c.model.posemb = "sincos1d"         # [UN] get_sinusoid_encoding(num_patches + 1), not trained
    c.model.qkv_bias = False            # [UN] T2T_ViT qkv_bias=False
    if c.model.norm.name == "layernorm":
        c.model.norm.epsilon = 1e-5     # [UN] torch nn.LayerNorm default (the LN baseline)
    # [UN] run_train.sh: 8 GPUs x --batch-size 64 (mix_groups 8), --lr 5e-4 (not rescaled by batch
    # size); main.py:119 --warmup-epochs 10. main.py:424/554 also runs create_scheduler's 10
    # cooldown epochs (main.py:121) at min-lr after the 300: not modelled here.
    timm_deit_training(c, batch=512, lr=5e-4, warmup_epochs=10, mix_groups=8)
    c.data.repeated_aug = 1             # [UN] no repeated augmentation (timm train.py)
    c.dtype = "float32"                 # [UN] fp32 (see the docstring)
    return c


def rescale_cifar10_b16(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """RescaleViT's CIFAR-10 from-scratch run [RV]: ViT-B/16 at 224, 20k steps of batch 128
    (README.md's table: LN 69.7, BN 66.5, GN 65.1, Rescale 65.2), its train.py defaults."""
    c.data.name = "cifar10"
    c.data.train_split = "train"
    c.data.eval_split = "test"
    c.data.image_size = 224             # [RV] train.py:304 --img_size 224
    c.data.crop_padding = 0
    c.data.random_resized_crop = True   # [RV] utils/data_utils.py:19 RandomResizedCrop(224, scale=(0.05, 1))
    c.data.min_crop_area = 0.05
    c.data.flip = False                 # [RV] utils/data_utils.py:18-22: no flip
    c.data.eval_crop_fraction = 1.0     # [RV] utils/data_utils.py:24 Resize((224, 224)) for test
    c.data.normalize = "minus_one_one"  # [RV] utils/data_utils.py:21 Normalize(0.5, 0.5)
    c.model.variant = "B/16"            # [RV] train.py:297 --model_type ViT-B_16
    c.model.dropout_rate = 0.1          # [RV] models/configs.py:44 get_b16_config dropout_rate 0.1
    c.model.attention_dropout_rate = 0.0  # [RV] models/configs.py:43
    c.model.gelu_approximate = False    # [RV] models/modeling.py:51,129 torch.nn.functional.gelu (exact erf)
    c.batch_size = 128                  # [RV] train.py:306 --train_batch_size 128
    c.total_steps = 20_000              # [RV] train.py:318 --num_steps 20000
    c.optimizer.name = "sgd"            # [RV] train.py:197-200 SGD momentum 0.9
    c.optimizer.momentum = 0.9
    c.optimizer.nesterov = False
    c.optimizer.learning_rate = 0.05    # [RV] train.py:314 --learning_rate 0.05 (train1.sh too)
    c.optimizer.weight_decay = 0.0      # [RV] train.py:316 --weight_decay 0
    c.optimizer.grad_clip = 1.0         # [RV] train.py:324 --max_grad_norm 1.0
    c.schedule.name = "cosine"          # [RV] train.py:320 --decay_type cosine
    c.schedule.warmup_steps = 500       # [RV] train.py:322 --warmup_steps 500
    c.schedule.end_factor = 0.0
    c.label_smoothing = 0.0
    c.model.stochastic_depth = 0.0
    c.dtype = "float32"                 # [RV] train1.sh ran apex O2 fp16; bf16 is an option here
    c.eval_batch_size = 512             # [RV] train.py:308
    c.log_every, c.eval_every, c.checkpoint_every = 100, 100, 1000  # [RV] train.py:310 --eval_every 100
    return c


# Presets shared by the method configs: name -> function of the config.
DEIT = {
    # [DTN] ViT-T* (4 heads of 48), ViT-S, ViT-B* (16 heads of 48): the paper's models
    "deit_t": lambda c: _heads(deit(c, "Ti/16"), 4),
    "deit_s": lambda c: deit(c, "S/16"),
    "deit_b": lambda c: _heads(deit(c, "B/16", gpus=16), 16),
    "dtn_code": dtn_released_code,      # after deit_*: DTN's released code instead of its paper
}
T2T = {"t2t_vit_14": lambda c: t2t_vit(c, "T2T-14")}  # UN's setting [UN]
BIGVISION = {
    "bigvision_s16_90ep": lambda c: bigvision_i1k(c, "S/16", 90.0),
    "bigvision_s16_300ep": lambda c: bigvision_i1k(c, "S/16", 300.0),  # [BV] vit_s16_i1k.py:27
}


def _heads(c: ml_collections.ConfigDict, n: int) -> ml_collections.ConfigDict:
    c.model.num_heads = n
    return c


# ==== RepBN / PRepBN (SLAB) and the normalization-free DyT / Derf ====
#   [SLAB] xinghaochen/SLAB @f58db00 classification/ (Swin Transformer's training code, not DeiT's):
#          README.md:65 (8 GPUs), :92-93 (deit_t_prepbn 73.6%, deit_s_prepbn 80.2%);
#          config.py (yacs defaults), cfgs/deit_{t,s}_prepbn.yaml, main.py, models/deit.py,
#          models/prepbn.py. Guo et al., "SLAB", ICML 2024.
#   [DyT]  jiachenzhu/DyT @aab5dde: README.md:42-72 (ViT-B/L commands), :116-119 (ImageNet-1k
#          top-1, LN / DyT: ViT-B 82.3 / 82.5, ViT-L 83.1 / 83.6), main.py (ConvNeXt's script),
#          dynamic_tanh.py. Zhu et al., "Transformers without Normalization", CVPR 2025.
#   [Derf] zlab-princeton/Derf @8dd9ea3: ViT/README.md:19-45 (commands), ViT/main.py (DyT's script
#          plus --normtype), ViT/dynamic_erf.py; README.md:40-43 (Derf ViT-B 82.8, ViT-L 83.8).
#          "Stronger Normalization-Free Transformers", arXiv 2512.10938.

def slab_deit(c: ml_collections.ConfigDict, variant: str,
              decay_steps: int | None = None) -> ml_collections.ConfigDict:
    """SLAB's DeiT-T/S [SLAB]: Swin's ImageNet-1k recipe on DeiT models; a progressive norm
    (LN -> RepBN) decays over ``decay_steps``."""
    # [SLAB] config.py:30 bicubic, timm create_transform (data/build.py:105-108); eval
    # data/build.py:121 Resize(256/224 x 224) + CenterCrop (config.py:171 TEST.CROP)
    imagenet_data(c, "zscore", True, "bicubic")
    c.model.variant = variant
    c.model.posemb = "learn"
    batch = 8 * 128                     # [SLAB] README.md:65 8 GPUs x config.py:22 BATCH_SIZE 128
    lr = 5e-4 * batch / 512             # [SLAB] config.py:110 BASE_LR 5e-4, main.py:89 x batch / 512
    # [SLAB] config.py:106-164 (epochs, wd, AdamW betas, cosine, RandAugment, erasing, Mixup/CutMix,
    # smoothing :58) equal the values timm_deit_training sets; :107 warm-up 20 epochs; 8 processes
    timm_deit_training(c, batch=batch, lr=lr, warmup_epochs=20, mix_groups=8)
    c.model.stochastic_depth = 0.0      # [SLAB] cfgs/deit_{t,s}_prepbn.yaml:6 DROP_PATH_RATE 0.0
    c.optimizer.grad_clip = 5.0         # [SLAB] config.py:114 CLIP_GRAD 5.0 (main.py:291)
    c.schedule.end_factor = 5e-6 / 5e-4  # [SLAB] config.py:112 MIN_LR 5e-6, scaled as the lr (main.py:91)
    c.ema_decay = 0.0                   # [SLAB] main.py keeps no model EMA (main_ema.py is another script)
    # Not modelled: the warm-up starts at 5e-7 x 2 (config.py:111), not 0; main.py:191-193 runs
    # 10 more epochs that only re-estimate BatchNorm statistics (update_model) after the 300.
    c.dtype = "bfloat16"                # [SLAB] main.py:52 --amp off (fp32) by default; bf16 here
    if decay_steps is not None and c.model.norm.name == "progressive":
        # [SLAB] models/prepbn.py:20 LinearNorm(warm=0, step=300000), used by models/deit.py:15,353
        # (deit_small_patch16_224_repbn; LN eps 1e-6 at :14): 300,000 of 300 x 1251 = 375,300 steps
        c.model.norm.decay_steps = decay_steps
        c.model.norm.warmup_steps = 0
    return c


def dyt_vit(c: ml_collections.ConfigDict, variant: str, code: str = "dyt") -> ml_collections.ConfigDict:
    """ViT-B/L on ImageNet-1k with ConvNeXt's training script as DyT's README runs it
    (``code='dyt'``) or as Derf's ViT/README.md does (``code='derf'``)."""
    large = variant.startswith("L")
    # [DyT] main.py:110 bicubic, :156 ImageNet mean/std; datasets.py:85-90 eval crop 224/256
    imagenet_data(c, "zscore", True, "bicubic")
    c.model.variant = variant
    # [DyT] README.md:42-45 / :61-65: 8 nodes x 8 GPUs x 64 = 4096 (ViT-B and -L); [Derf]
    # ViT/README.md:19-21 ViT-B 4 x 8 x 128, :33-36 ViT-L 8 x 8 x 64 (:45: 4096 in all)
    groups = 32 if (code == "derf" and not large) else 64
    # [DyT] main.py:93 lr 4e-3 ("with total batch size 4096", not rescaled), :98 warm-up 20 epochs;
    # :56 300 epochs, :87 wd 0.05, :106 --aa, :108 smoothing, :117-119 erasing 0.25 pixel,
    # :127-137 Mixup 0.8 / CutMix 1.0 / prob 1 / switch 0.5 / batch (Derf's ViT/main.py alike)
    timm_deit_training(c, batch=4096, lr=4e-3, warmup_epochs=20, mix_groups=groups)
    c.schedule.end_factor = 1e-6 / 4e-3  # [DyT] main.py:96 --min_lr 1e-6
    # [DyT] main.py:297 timm global_pool='avg' (class token kept): patch tokens pooled, then fc_norm
    c.model.classifier = "token_gap_fc_norm"
    if code == "dyt":  # [DyT] README.md:43 --drop_path 0.1 (B), :63 0.4 (L)
        c.model.stochastic_depth = 0.4 if large else 0.1
    else:              # [Derf] ViT/main.py:61 default 0.15 (B: README passes none), README.md:35 0.5 (L)
        c.model.stochastic_depth = 0.5 if large else 0.15
    if large:
        c.optimizer.b1, c.optimizer.b2 = 0.9, 0.95  # [DyT] README.md:69; [Derf] ViT/README.md:40
    c.ema_decay = 0.9999                # [DyT] main.py:72 decay, README.md:48-49 EMA on and evaluated
    c.dtype = "bfloat16"                # [DyT] main.py:194 --use_amp off (fp32) by default; bf16 here
    return c


SLAB = {
    "slab_deit_t": lambda c: slab_deit(c, "Ti/16"),                        # RepBN from the start
    "slab_deit_s": lambda c: slab_deit(c, "S/16", decay_steps=300_000),    # progressive LN->RepBN
}
NORM_FREE = {"dyt_b": lambda c: dyt_vit(c, "B/16"), "dyt_l": lambda c: dyt_vit(c, "L/16")}
NORM_FREE_DERF = {"dyt_b": lambda c: dyt_vit(c, "B/16", "derf"),
                  "dyt_l": lambda c: dyt_vit(c, "L/16", "derf")}
# ==== end of the SLAB / DyT / Derf presets ====

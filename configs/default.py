"""Base configuration shared by every method's config. Every field is documented here.

Override any value on the command line, e.g. ``--config.batch_size=256 --config.model.depth=24``.
Method configs (``vit_<method>.py``) start from ``get_config()`` here and change what they need.
The accepted range of every numeric key is in normvit_jax/config_ranges.py (a value outside it
stops the run at start with exit 2 naming the key, the value and the range).
"""
from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder


def typed(value, field_type: type) -> ml_collections.FieldReference:
    """A field that keeps its type when a variant sets it to None, so that
    ``--config.<key>=...`` can still set it afterwards (a plain None field cannot be overridden)."""
    return ml_collections.FieldReference(value, field_type=field_type)


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0                      # one seed for init, data order, augmentation and dropout

    # ---- data (normvit_jax/data) ----
    c.data = ml_collections.ConfigDict()
    c.data.name = "cifar10"         # digits | cifar10 | cifar100 | imagenet2012 | a dataset made by
                                    # `python -m normvit_jax.data.prepare` in data.data_dir (docs/data.md)
    c.data.data_dir = placeholder(str)  # tfds data dir (None: $TFDS_DATA_DIR or ~/tensorflow_datasets); gs:// ok
    c.data.train_split = "train"    # tfds split string used for training
    c.data.eval_split = "test"      # tfds split used for evaluation ('validation' for imagenet2012; a prepared
                                    # dataset without 'test': its own eval split, e.g. 'val')
    c.data.eval_name = placeholder(str)  # tfds dataset to evaluate on (None: data.name); ImageNet
                                    # models also: imagenet_v2 (split 'test'), imagenet2012_real
                                    # ('validation': adds ReaL top-1); a prepared dataset's run: another
                                    # prepared set of its classes; normalized with data.name's stats
    c.data.image_size = 32          # model input resolution (square); images are resized to it
    c.data.normalize = "minus_one_one"  # minus_one_one | zero_one | zscore (per-channel dataset stats) | minmax
                                    # | imagenet: timm's ImageNet mean/std on any dataset (DeiT/timm-trained models)
    c.data.crop_padding = 4         # train: random crop after zero-padding by this many pixels of image_size (0: off)
    c.data.random_resized_crop = False  # train: Inception-style crop (ImageNet) instead of pad-and-crop
    c.data.min_crop_area = 0.08     # smallest area fraction for random_resized_crop
    c.data.flip = True              # train: random horizontal flip
    c.data.eval_crop_fraction = 1.0  # eval: central crop fraction before resizing (0.875 for ImageNet)
    c.data.eval_resize_small = 0    # eval: big_vision's resize_small(n) ('area') then central_crop(image_size)
                                    # instead of the eval_crop_fraction crop and resize (0: off)
    c.data.antialias = True         # resizes that shrink widen the filter (PIL's, timm's); False:
                                    # plain interpolation (big_vision's inception crop), ~2x faster JPEG decoding
    c.data.interpolation = "bilinear"  # bilinear | bicubic (DeiT: PIL's) | random (timm's train default:
                                       # either per image; evaluates bicubic), train and eval resizes
    c.data.repeated_aug = 1         # DeiT's repeated augmentation: each example r times per batch (own
                                    # augmentations), epochs keep N samples (data/order.py; 1: off; DeiT: 3)
    c.data.prefetch = 2             # host batches prepared ahead of the train step
    c.data.num_train_examples = placeholder(int)  # use only the first N train examples (tests with mock data)
    c.data.num_eval_examples = placeholder(int)   # use only the first N eval examples (tests with mock data)
    c.data.num_workers = placeholder(int)  # tf.data threads decoding one batch's JPEGs (4 batches at once;
                                    # None: min(32, usable CPUs)); also the threads reading array_record CIFAR
    c.data.return_index = False     # batches also carry 'index' (int32 position in the split; -1 = padding)
    c.data.in_memory_mb = 1024.0    # a split of encoded images (a prepared dataset, ImageNet) whose decoded
                                    # images (examples x image_size^2 x 3 bytes) fit in this many MiB is
                                    # decoded once at start and augmented from memory: the same batches,
                                    # bit for bit; not with random_resized_crop or 'random' interpolation
                                    # in training (their first stage draws); per split (0: decode every batch)

    # ---- model (normvit_jax/models/vit.py) ----
    c.model = ml_collections.ConfigDict()
    c.model.name = "vit"            # vit | t2t_vit (Tokens-to-Token stem; its keys: configs/recipes.py t2t_vit)
    c.model.variant = typed("Ti/4", str)  # '<Ti|S|B|L|H>/<patch>'; explicit fields below win over it
    c.model.hidden_size = placeholder(int)  # width (None: from variant)
    c.model.depth = placeholder(int)        # transformer blocks (None: from variant)
    c.model.num_heads = placeholder(int)    # attention heads (None: from variant)
    c.model.mlp_dim = placeholder(int)      # MLP hidden width (None: mlp_ratio * hidden)
    c.model.mlp_ratio = 4.0                 # mlp_dim / hidden_size when mlp_dim is None
    c.model.patch_size = placeholder(int)   # square patch side in pixels (None: from variant)
    c.model.classifier = "token"    # token (class token) | gap (global average pooling) |
    # gap_fc_norm (timm's global_pool='avg': pool the tokens, then the final norm on that vector) |
    # token_gap_fc_norm (the same with timm's class token in the sequence, left out of the mean)
    c.model.posemb = "learn"        # learn | sincos2d | sincos1d (fixed 1-D table, class token at 0) | none
    c.model.cls_token_at_block = 0  # >0: the class token joins before this block (DTN's layout); <0: depth + value
    c.model.norm = ml_collections.ConfigDict({"name": "layernorm"})  # the norm of every slot; options beside name
    c.model.norm_overrides = ml_collections.ConfigDict()  # 'final' | 'block_<i>' | 'blocks_<a>_<b>' | 'last_<k>' -> norm config
    c.model.norm_placement = "pre"  # pre | post | sandwich
    c.model.patch_norm = "none"     # Dual PatchNorm stem: none | pre | post | dual | post_posemb
    c.model.residual_scaling = "none"  # none | rescale (RescaleViT's residual scaling)
    c.model.final_norm = True       # the encoder's last norm ('encoder_norm'; 'fc_norm' with *gap_fc_norm)
    c.model.representation_size = placeholder(int)  # pre_logits width
    c.model.dropout_rate = 0.0      # dropout: embeddings, MLP hidden layer, residual branches
    c.model.attention_dropout_rate = 0.0  # dropout on the attention probabilities
    c.model.stochastic_depth = 0.0  # drop-path rate of the last block (linear from 0)
    c.model.gelu_approximate = True  # tanh GELU as Google's checkpoints; False: exact erf as timm
    c.model.qkv_bias = True         # False: query/key/value projections without bias (timm's qkv_bias=False)
    c.model.param_init = "google"   # google: vit_jax/big_vision's (xavier, zero head) | timm: DeiT's/T2T-ViT's
                                    # (every Linear and the class token normal(0.02), torch's conv default)
    c.model.attention_impl = "auto"  # auto: fused_sdpa on GPU (cuDNN attention), fused elsewhere;
                                    # fused: one QKV matmul + einsum attention (fastest on CPU);
                                    # fused_sdpa: one QKV matmul + jax.nn.dot_product_attention;
                                    # separate: 3 DenseGeneral + dot_product_attention
    c.model.fusion_barriers = "auto"  # auto (CPU only) | on | off: store the residual gradient per block
                                    # instead of XLA:CPU recomputing it (docs/benchmarks.md)
    c.model.recompute = "none"      # none | gelu: the MLP's backward recomputes the GELU's output from its
                                    # input instead of keeping it (per block one (B, T, mlp_dim) activation
                                    # less in memory, one elementwise pass more); config.remat: whole blocks
    c.model.stream_layout = "auto"  # auto (GPU only) | row_major | free: pin the residual stream's layout to
                                    # (batch, tokens, channels) at each block; XLA:GPU otherwise lays it out
                                    # batch-innermost and transposes it around every norm (docs/benchmarks.md)
    c.model.scan = False            # nn.scan over the leading identical blocks (fast compile of deep models;
                                    # params under Transformer/encoderblock, see models/scan_convert.py)
    # model.name='t2t_vit' (models/t2t_vit.py): configs/recipes.py t2t_vit adds these keys, so only
    # its configs have them (defaults: T2TSpec's):
    #   model.variant            'T2T-<7|10|12|14|19|24>' (width, depth, heads, mlp ratio)
    #   model.token_dim          64: width of the Tokens-to-Token stem's Performer layers
    #   model.kernel_ratio       0.5: Performer random features per stem channel (m = token_dim * ratio)
    #   model.t2t_dropout_rate   0.1: dropout inside the stem's Performer layers
    #   model.stem_norm          the stem's four norm slots; {'name': None}: model.norm

    # ---- optimization (normvit_jax/train) ----
    c.batch_size = 128              # global batch over all devices and hosts
    c.eval_batch_size = 256         # global eval batch; the last batch is padded and masked
    c.num_epochs = 100.0            # used when total_steps is None; > 0
    c.total_steps = placeholder(int)  # None: num_epochs; else >= 1
    c.grad_accum_steps = 1          # micro-batches per update (the global batch is split)
    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"      # adamw | sgd | lamb (timm's Lamb: trust ratio only where weight decay
                                    # applies, lamb_grad_clip inside) | lamb_optax (optax.lamb: trust ratio on all)
    c.optimizer.learning_rate = 1e-3  # peak learning rate
    c.optimizer.weight_decay = 0.05   # decoupled; never on biases, norm params, posemb, cls token
    c.optimizer.b1 = 0.9            # adam/lamb beta1
    c.optimizer.b2 = 0.999          # adam/lamb beta2
    c.optimizer.momentum = 0.9      # sgd momentum
    c.optimizer.nesterov = False    # sgd
    c.optimizer.grad_clip = typed(1.0, float)  # global-norm clip (None or 0: off)
    c.optimizer.lamb_grad_clip = typed(1.0, float)  # lamb: timm Lamb's max_grad_norm, a second global-norm
                                    # clip inside the optimizer, after grad_clip (None or 0: off)
    c.schedule = ml_collections.ConfigDict()
    c.schedule.name = "cosine"      # cosine | linear | constant | ls_custom (LearnableScaler's --sched custom,
                                    # per epoch: train/optimizer.py ls_custom), after warmup
    c.schedule.warmup_steps = 500   # linear warmup from 0 to the peak learning rate (0: none);
                                    # at most the run's steps - 1 (a longer one is shortened to
                                    # that, with a warning line at start)
    c.schedule.end_factor = 0.0     # final lr as a fraction of the peak (cosine, linear)
    c.schedule.epoch_factor = 0.8   # ls_custom: lr x this until epoch_threshold (--epoch-factor)
    c.schedule.epoch_threshold = 0.5  # ls_custom: fraction of the epochs (--epoch-threshold)
    c.schedule.final_fraction = 0.66  # ls_custom: back on the cosine from this fraction (hard-coded there)
    c.label_smoothing = 0.0         # also applied to Mixup/CutMix's soft targets (as timm)
    c.layer_decay = 1.0             # layer-wise lr decay (BEiT/MAE fine-tuning): lr of block i scaled by
                                    # layer_decay^(depth - i), embeddings by ^(depth + 1), head/final norm 1
                                    # (1.0: off; train/layer_decay.py)
    # LearnableScaler's extra losses (train/aux_losses.py; its train.py --train-feature-decay,
    # --attn-extra-loss, --attn-extra-loss-layers): loss = CE + fd * (fd * sum F + a * sum A)
    c.feature_decay = 0.0           # fd: penalty on residual-stream entries above the threshold, after each
                                    # residual add of every block: mean + max of |x| - threshold (0: off)
    c.feature_decay_threshold = 200.0  # |x| above which feature decay acts (hard-coded 200 there)
    c.attn_extra_loss = 0.0         # a: 1 - mean of the per-query max attention probabilities < 0.5, first
                                    # attn_extra_loss_layers blocks; needs feature_decay > 0 (0: off)
    c.attn_extra_loss_layers = 0    # blocks (from the first) with the attention loss (above the depth: all)
    c.ema_decay = 0.0               # EMA of the weights per step (DeiT's model EMA: 0.99996; 0: off); kept in
                                    # the optimizer state, evaluated beside the raw weights as eval/ema_*;
                                    # predict, export, reparam, recalibrate, analysis take it with --weights=ema
    c.ema_batch_stats = True        # with ema_decay: also average the norm statistics (batch_stats), as timm's
                                    # model EMA averages buffers; False: EMA weights with the raw statistics

    # ---- on-device batch augmentation in the train step (train/batch_aug.py; timm semantics) ----
    c.mixup_alpha = 0.0             # Mixup's Beta(a, a) (DeiT: 0.8; 0: off)
    c.cutmix_alpha = 0.0            # CutMix's Beta(a, a) (DeiT: 1.0; 0: off); lam corrected by the box area
    c.mix_prob = 1.0                # probability that a batch/pair/row is mixed
    c.switch_prob = 0.5             # with both alphas > 0: probability of CutMix instead of Mixup
    c.mix_mode = "batch"            # batch (one draw per batch) | pair (per pair i, B-1-i) | elem (per row)
    c.mix_groups = 1                # draws per global batch: timm draws per GPU process (and per accumulation
                                    # micro-batch); each of these consecutive slices mixes within itself
    c.cutmix_box = "even"           # even: box rows [c - cut//2, c + cut//2) (timm <= 1.0.28, DeiT's 0.3.2) |
                                    # exact: [c - cut//2, c + (cut+1)//2) (timm >= 1.0.29)
    c.randaugment = ""              # RandAugment per image, first (train/randaugment.py; docs/recipes.md):
                                    # '' off | timm string 'rand-m9-mstd0.5-inc1' (DeiT; sections m n p mstd
                                    # mmax inc) | 'bigvision-2-10' (big_vision randaug(2, 10))
    c.random_erase_prob = 0.0       # random erasing per image (DeiT: 0.25; 0: off), before mixing
    c.random_erase_mode = "pixel"   # pixel (per-pixel normal noise) | rand (per channel) | const (zeros)

    # ---- precision and memory ----
    c.dtype = "float32"             # compute dtype: float32 | bfloat16 | float16 (no loss scaling: small
                                    # gradients underflow); params and stats stay float32
    c.remat = False                 # activation checkpointing per block
    c.reproducible_cpu_threads = 0  # >0: XLA:CPU on this many threads with AVX2 code and no YNNPACK: the
                                    # same numbers on any core count of a CPU model, not across models
                                    # (normvit_jax/reproducible.py; main.py sets it before JAX starts,
                                    # train_and_evaluate too if JAX has not started, else it warns);
                                    # 0: XLA's defaults, every core

    # ---- device mesh (normvit_jax/sharding.py; README "Sharded parameters (FSDP)") ----
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1                # data-parallel axis size (-1: the devices left after fsdp)
    c.mesh.fsdp = 1                 # FSDP axis size: the batch is split over data x fsdp devices, and
                                    # each state array (params, optimizer moments, EMA) with at least
                                    # fsdp_min_size elements is split over fsdp along its largest
                                    # divisible axis (1: all replicated, plain data parallelism)
    c.mesh.fsdp_min_size = 2 ** 14  # smaller arrays (biases, norm scales, batch stats) stay replicated

    # ---- loop, checkpoints, logging ----
    c.log_every = 50                # steps between train metric writes
    c.eval_every = 1000             # steps between evaluations (and at the end)
    c.checkpoint_every = 1000       # steps between checkpoints (and at the end)
    c.keep_checkpoints = 3          # newest checkpoints kept
    c.init_from = placeholder(str)  # path or gs:// of a Google ViT .npz or a timm / HF / original-code
                                    # state dict (.safetensors, .pth/.bin) to start from; --mode=import:
                                    # the model to import (docs/pretrained.md)
    c.init_keep_pre_logits = placeholder(bool)  # keep the file's pre_logits layer (None: if model.representation_size)
    c.init_reset_head = False       # zero the file's head even where its shape fits (another dataset's classes)
    c.init_source_grid = placeholder(str)  # the file's posemb grid 'ROWSxCOLS' when it is not square (None: square)
    c.allow_config_change = False   # resume a workdir whose saved config differs
    c.skip_nonfinite_steps = 0      # 0: stop on a NaN/Inf; N: skip such updates, stop after N in a row
    c.eval_analysis_images = 16     # eval images whose token statistics, norm gates and attention
                                    # distances are written to TensorBoard per eval (0: off)
    c.eval_attention_images = 0     # of those, how many get an attention-map image per eval
    return c


def get_demo(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turns a config into the offline demo: sklearn's 8x8 digits, a tiny ViT, ~1 minute on CPU."""
    c.data.name = "digits"
    c.data.image_size = 8
    c.data.crop_padding = 0         # a 1-pixel shift of an 8x8 digit hurts (measured: 94.9% vs 96.6%)
    c.data.flip = False             # digits are not mirror-symmetric
    c.label_smoothing = 0.1
    c.model.stochastic_depth = 0.1
    c.data.normalize = "zero_one"
    c.model.variant = None
    c.model.patch_size = 2
    c.model.hidden_size = 64
    c.model.depth = 4
    c.model.num_heads = 4
    c.model.mlp_dim = 128
    c.batch_size = 64
    c.eval_batch_size = 128
    c.reproducible_cpu_threads = 2  # the README's numbers on any core count (no faster with more threads)
    c.num_epochs = 40.0
    c.optimizer.learning_rate = 3e-3
    c.optimizer.weight_decay = 0.05
    c.schedule.warmup_steps = 100
    c.log_every = 50
    c.eval_every = 250
    c.checkpoint_every = 250
    return c


SMALL32_STEPS = 300  # configs/<method>.py:small32's run length (vit_progressive.py decays over 80%)


def get_small32(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Small photographs (about 32 px, some thousands of images; a prepared dataset or CIFAR) on
    a CPU: a ViT of width 96, depth 6, patch 4 (64 tokens) for a fixed 300 steps of 128 images
    with crop padding and flips; measured in docs/data.md ("Small images on a CPU")."""
    c.data.image_size = 32
    c.data.crop_padding = 4         # photos: shifts and mirror images are still photos
    c.data.flip = True
    c.model.variant = None
    c.model.patch_size = 4
    c.model.hidden_size = 96
    c.model.depth = 6
    c.model.num_heads = 3
    c.model.mlp_dim = 192
    c.model.stochastic_depth = 0.1
    c.label_smoothing = 0.1
    c.batch_size = 128
    c.eval_batch_size = 256
    c.total_steps = SMALL32_STEPS   # a fixed length: the run time does not grow with the dataset
    c.optimizer.learning_rate = 2e-3
    c.optimizer.weight_decay = 0.05
    c.schedule.warmup_steps = 90    # 30% of the run
    c.log_every = 25
    c.eval_every = c.checkpoint_every = 100
    return c


def get_cifar100(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    c.data.name = "cifar100"
    return c


def get_imagenet(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """ImageNet-1k at 224 with a S/16 (DeiT-style recipe, 300 epochs, batch 1024)."""
    c.data.name = "imagenet2012"
    c.data.eval_split = "validation"
    c.data.image_size = 224
    c.data.crop_padding = 0
    c.data.random_resized_crop = True
    c.data.eval_crop_fraction = 0.875
    c.data.antialias = False  # big_vision's inception crop: the host decodes ~2x more images/s
    c.data.normalize = "minus_one_one"
    c.model.variant = "S/16"
    c.batch_size = 1024
    c.eval_batch_size = 1024
    c.num_epochs = 300.0
    c.optimizer.learning_rate = 5e-4 * c.batch_size / 512
    c.optimizer.weight_decay = 0.05
    c.schedule.warmup_steps = 5 * 1251
    c.label_smoothing = 0.1
    c.model.stochastic_depth = 0.1
    c.dtype = "bfloat16"
    c.log_every = 100
    c.eval_every = 5000
    c.checkpoint_every = 2000
    return c


VARIANTS = {"demo": get_demo, "small32": get_small32, "cifar100": get_cifar100,
            "imagenet": get_imagenet}


def apply_variants(c: ml_collections.ConfigDict, arg: str | None,
                   presets: dict | None = None) -> ml_collections.ConfigDict:
    """Applies the comma-separated variants of ``file.py:a,b`` in order (e.g. 'imagenet' or 'demo').

    A model size such as 's16' or 'b32' sets ``model.variant``. ``presets``: a method config's own
    named recipes (``vit_dtn.py:deit_s``), functions of the config like the entries of VARIANTS.
    Unknown variants raise a ValueError naming the accepted ones.
    """
    table = {**VARIANTS, **(presets or {})}
    for part in [p.strip() for p in (arg or "").split(",") if p.strip()]:
        if part in table:
            c = table[part](c)
        elif part[:2].lower() == "ti" and part[2:].isdigit():
            c.model.variant = f"Ti/{part[2:]}"
        elif part[:1].lower() in "sblh" and part[1:].isdigit():
            c.model.variant = f"{part[0].upper()}/{part[1:]}"
        else:
            raise ValueError(f"unknown config variant {part!r}; accepted: {sorted(table)} or a "
                             "model size like 'ti16', 's16', 'b32'")
    return c

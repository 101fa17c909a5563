"""Fine-tune a Google ImageNet-21k ViT (vit_jax or AugReg .npz) on any dataset, your own included.

    python -m normvit_jax.data.prepare --src=~/flower_photos --name=my_flowers --data_dir=~/tfds
    python main.py --config=configs/finetune.py:b16 --config.data.name=my_flowers \\
        --config.data.data_dir=~/tfds --config.init_from=/local/ViT-B_16.npz --workdir=runs/ft

``configs/finetune_cifar.py``'s recipe and variants (model b16|b32|l16|l32, 224|384, i21k|augreg,
accum<N>, a norm name; see there) with the dataset left to ``--config.data.name`` (default
cifar10; cifar10/cifar100 also accepted in the argument): the head is zeroed where the file's class
count differs from the dataset's (read from a prepared dataset's files); a head of the same shape
is kept unless ``--config.init_reset_head=True``. A timm/HF file also wants
``--config.data.normalize=imagenet`` (timm's ImageNet-1k ViTs) and
``--config.model.gelu_approximate=False`` (docs/data.md). Splits: ``train`` for training
(no 2% hold-out: a prepared dataset has its own eval split), ``data.eval_split`` 'test', which for a
prepared dataset without a 'test' split means its own eval split (docs/data.md). For a small
dataset lower ``total_steps``/``schedule.warmup_steps`` and ``batch_size`` (docs/data.md).
"""
from __future__ import annotations

import ml_collections

from configs import finetune_cifar


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = finetune_cifar.get_config(arg)
    c.data.train_split = "train"
    c.data.eval_split = "test"
    return c

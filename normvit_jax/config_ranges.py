"""The range of every numeric key of configs/default.py that has one, checked before anything is
built (preflight.check and train/setup.validate_config), so ``label_smoothing=1.5`` or
``model.depth=0`` is refused with one line naming the key, its value and the range, instead of
training something meaningless or being read as "unset".

None is accepted only where it has a meaning (``NONE_MEANS``: ``total_steps=None``: use
num_epochs; ``grad_clip=None``: off; a ``model.*`` key: the model family's default) and refused
with the range elsewhere (``--config.log_every=None`` was a TypeError traceback from the loop).
Keys without a range (``seed``) and keys whose range depends on others (``mesh.data``: -1 or
a divisor of the device count; ``model.cls_token_at_block``: within the depth) are listed in
``UNBOUNDED`` and checked where the other values are known.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Range:
    """low <= value (< if ``low_open``) and value <= high (< if ``high_open``); ``integer``: a
    whole number. A bound of None is unbounded."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            return (f"{kind} in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        return f"{kind} {'<' if self.high_open else '<='} {self.high:g}"


def _count(low: int = 0) -> Range:
    return Range(low=low, integer=True)


PROBABILITY = Range(0, 1)
RATE = Range(0, 1, high_open=True)  # a drop or smoothing rate of 1 leaves nothing to learn from

RANGES: dict[str, Range] = {
    "data.image_size": _count(1),
    "data.crop_padding": _count(0),
    "data.min_crop_area": Range(0, 1, low_open=True),
    "data.eval_crop_fraction": Range(0, 1, low_open=True),
    "data.repeated_aug": _count(1),
    "data.eval_resize_small": _count(0),
    "data.prefetch": _count(0),  # 0: synchronous
    "data.num_train_examples": _count(1),
    "data.num_eval_examples": _count(1),
    "data.num_workers": _count(1),
    "data.in_memory_mb": Range(0),  # 0: off
    "model.hidden_size": _count(1),
    "model.depth": _count(1),
    "model.num_heads": _count(1),
    "model.mlp_dim": _count(1),
    "model.mlp_ratio": Range(0, low_open=True),
    "model.patch_size": _count(1),
    "model.representation_size": _count(1),
    "model.dropout_rate": RATE,
    "model.attention_dropout_rate": RATE,
    "model.stochastic_depth": RATE,
    "batch_size": _count(1),
    "eval_batch_size": _count(1),
    "num_epochs": Range(0, low_open=True),
    "total_steps": _count(1),
    "grad_accum_steps": _count(1),
    "optimizer.learning_rate": Range(0, low_open=True),
    "optimizer.weight_decay": Range(0),
    "optimizer.b1": Range(0, 1, high_open=True),
    "optimizer.b2": Range(0, 1, high_open=True),
    "optimizer.momentum": Range(0, 1, high_open=True),
    "optimizer.grad_clip": Range(0),
    "optimizer.lamb_grad_clip": Range(0),
    "schedule.warmup_steps": _count(0),
    "schedule.end_factor": Range(0, 1),
    "schedule.epoch_factor": Range(0, low_open=True),
    "schedule.epoch_threshold": Range(0, 1, low_open=True, high_open=True),
    "schedule.final_fraction": Range(0, 1, low_open=True),
    "label_smoothing": RATE,
    "layer_decay": Range(0, 1, low_open=True),
    "ema_decay": Range(0, 1, high_open=True),
    "mixup_alpha": Range(0),
    "cutmix_alpha": Range(0),
    "mix_prob": PROBABILITY,
    "switch_prob": PROBABILITY,
    "mix_groups": _count(1),
    "feature_decay": Range(0),
    "feature_decay_threshold": Range(0),
    "attn_extra_loss": Range(0),
    "attn_extra_loss_layers": _count(0),
    "random_erase_prob": PROBABILITY,
    "mesh.fsdp": _count(1),
    "mesh.fsdp_min_size": _count(0),
    "log_every": _count(1),
    "eval_every": _count(1),
    "checkpoint_every": _count(1),
    "keep_checkpoints": _count(1),
    "reproducible_cpu_threads": _count(0),
    "skip_nonfinite_steps": _count(0),
    "eval_analysis_images": _count(0),
    "eval_attention_images": _count(0),
}

UNBOUNDED = ("seed", "mesh.data", "model.cls_token_at_block")

# The keys of RANGES and UNBOUNDED that may be None, and what None means; every model.* key may be
# (the family's default: models.spec.ViTSpec.resolve_partial).
NONE_MEANS: dict[str, str] = {
    "total_steps": "train num_epochs",
    "num_epochs": "train total_steps steps",
    "data.num_train_examples": "every train example",
    "data.num_eval_examples": "every eval example",
    "data.num_workers": "min(32, usable CPUs)",
    "optimizer.grad_clip": "no clipping",
    "optimizer.lamb_grad_clip": "no clipping inside Lamb",
}


def none_allowed(key: str) -> bool:
    return key in NONE_MEANS or key.startswith("model.")

# Numeric options of a norm (model.norm, model.norm_overrides.<key>), by name, whichever norm has
# them; norms.registry.create checks them. Out of range, they trained to NaN or to a NaN eval.
NORM_OPTIONS: dict[str, Range] = {
    "epsilon": Range(0),
    "group_epsilon": Range(0),
    "momentum": PROBABILITY,   # running = momentum * running + (1 - momentum) * batch
    "alpha_fwd": PROBABILITY,  # PowerNorm's running quadratic mean, as momentum
    "alpha_bkw": PROBABILITY,  # PowerNorm's backward running mean, as momentum
}


def _get(config: Any, key: str) -> tuple[bool, Any]:
    node = config
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return False, None
        node = node[part]
    return True, node


def check(config: Any) -> None:
    """Raises ValueError naming the first key whose value is outside its range, or None where
    None has no meaning."""
    for key in UNBOUNDED:
        present, value = _get(config, key)
        if present and value is None and not none_allowed(key):
            raise ValueError(f"config.{key}=None is not accepted; accepted: an integer")
    for key, allowed in RANGES.items():
        present, value = _get(config, key)
        if present and value is None and not none_allowed(key):
            raise ValueError(f"config.{key}=None is not accepted; accepted: {allowed.describe()}")
        if present and value is not None and not allowed.contains(value):
            raise ValueError(f"config.{key}={value!r} is out of range; accepted: "
                             f"{allowed.describe()}")


def check_extra_losses(config: Any) -> None:
    """LearnableScaler's attention loss exists only inside its feature decay's path (its Block
    returns before it otherwise, ignoring the flag): refuse it alone instead of ignoring it.
    A rule between two keys, so not part of ``check`` (preflight.check_values runs both)."""
    present, attn = _get(config, "attn_extra_loss")
    fd = _get(config, "feature_decay")[1]
    if present and attn and not fd:
        raise ValueError(f"config.attn_extra_loss={attn!r} needs config.feature_decay > 0 (the "
                         "reference adds the attention loss inside the feature decay); accepted: "
                         "attn_extra_loss=0 or feature_decay > 0")


def check_norm_options(norm_name: str, opts: Any, cls: type | None = None) -> None:
    """Raises ValueError naming the first option of norm ``norm_name`` outside its range, or None
    where the norm class ``cls`` does not default that option to None (None meaning something
    there); ``--config.model.norm.epsilon=None`` was a TypeError traceback at the first step."""
    defaults = ({f.name: f.default for f in dataclasses.fields(cls)}
                if cls is not None and dataclasses.is_dataclass(cls) else {})
    for key, allowed in NORM_OPTIONS.items():
        if key not in opts:
            continue
        value = opts[key]
        if value is None and defaults.get(key, dataclasses.MISSING) is not None:
            raise ValueError(f"norm {norm_name!r}: {key}=None is not accepted; accepted: "
                             f"{allowed.describe()}")
        if value is not None and not allowed.contains(value):
            raise ValueError(f"norm {norm_name!r}: {key}={value!r} is out of range; accepted: "
                             f"{allowed.describe()}")

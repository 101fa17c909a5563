"""One jitted capture forward of a ViT: attention maps and distances, token statistics per slot.

The model records attention weights and token statistics only under ``capture=True`` with the
``intermediates`` collection mutable; training never asks for them.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from normvit_jax import checkpoints, data, models, run_data
from normvit_jax.models import scan_convert
from normvit_jax.analysis import colors, distance
from normvit_jax.data import stats as data_stats
from normvit_jax.data.dataspec import DataSpec

_BLOCK = re.compile(r"^encoderblock_(\d+)$")


@dataclasses.dataclass
class Run:
    """A trained run loaded for analysis (float32 model built from the saved config; its
    hyperparameters are ``model.spec``)."""

    workdir: str
    config: ml_collections.ConfigDict
    data: DataSpec  # resolved from the saved config
    model: Any
    variables: dict
    step: int
    method: str
    weights: str = "raw"  # --weights: 'raw' or 'ema' (checkpoints.choose_weights)


@dataclasses.dataclass
class Analysis:
    """Numpy results of one capture forward on B images.

    stats: slot path ('encoderblock_0/LayerNorm_0', 'encoder_norm') -> {'in'|'out': {stat: value}}.
    distance: (depth, B, H) mean attention distance in pixels. cls_maps: per block (B, H, gh, gw),
    the class token's attention to the patches, or where a block has no class token in its
    sequence (DTN's late class token, GAP) the mean attention each patch receives.
    has_cls: per block. attention: per block (B, H, T, T) if asked for.
    """

    stats: dict[str, dict[str, dict[str, float]]]
    distance: np.ndarray
    cls_maps: list[np.ndarray]
    has_cls: list[bool]
    attention: list[np.ndarray] | None


def latest_step(workdir: str) -> int:
    checkpoints.require_run(workdir)
    steps = checkpoints.complete_steps(workdir)
    if not steps:
        raise checkpoints.no_checkpoint(workdir)
    return steps[-1]


def build_model(config: ml_collections.ConfigDict, data_spec: DataSpec) -> Any:
    """The float32 model of a run config (its ``spec`` holds every hyperparameter)."""
    return models.create(config, data_spec.num_classes)


def load_run(workdir: str, step: int | None = None, weights: str | None = None) -> Run:
    """A run's checkpoint (``step`` None: the newest that restores), its raw or EMA weights
    (``weights``: --weights, ``checkpoints.choose_weights``)."""
    # the shared restore path: a damaged newest checkpoint is named and the previous one used
    variables, config, record = checkpoints.restore_weights(workdir, step, weights)
    ds = run_data.inference_spec(workdir, data.resolve_data_spec(config))  # as trained
    return Run(str(workdir), config, ds, build_model(config, ds), variables, record["step"],
               colors.method_of(config), record["weights"])


def geometry(spec: Any, image_size: int) -> tuple[tuple[int, int], int]:
    """((rows, cols) of the patch grid of square images, patch size in pixels) of a ``ViTSpec``."""
    s = int(image_size) // spec.patch_size
    return (s, s), spec.patch_size


def eval_images(config: ml_collections.ConfigDict, data_spec: DataSpec,
                n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n images of the eval split (model inputs, float32) and their labels. Read as
    they come: decoding the whole split into memory (``data.in_memory_mb``, the training
    loop's) for a few images had doubled the eval split's decoding time and memory in a run."""
    config = copy.deepcopy(config)
    with config.unlocked():
        config.data.in_memory_mb = 0
    pipe = data.make_pipeline(config, "eval", data_spec, process_index=0, process_count=1)
    pipe_affine = data_spec.affine
    xs, ys = [], []
    for b in range(pipe.steps_per_epoch):
        batch = pipe.eval_batch(b)
        real = batch["mask"] > 0
        xs.append(data_stats.model_input(batch["image"][real], pipe_affine))
        ys.append(batch["label"][real])
        if sum(len(x) for x in xs) >= n:
            break
    pipe.close()
    return np.concatenate(xs)[:n], np.concatenate(ys)[:n]


def display_images(images: np.ndarray, data_spec: DataSpec) -> np.ndarray:
    """Model inputs back to [0, 1] pixels (undoes ``data_spec.normalize``)."""
    scale, shift = data_spec.affine
    return np.clip((np.asarray(images, np.float32) - shift) / scale, 0.0, 1.0)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def parse_intermediates(tree: dict) -> tuple[list[Any], dict[str, dict[str, dict[str, Any]]]]:
    """(attention per block in block order, stats per slot path) from the 'intermediates' tree
    (unrolled or scanned encoder)."""
    attention: dict[int, Any] = {}
    stats: dict[str, dict[str, dict[str, Any]]] = {}

    def walk(node: dict, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            if key == "attention":
                block = next(int(m.group(1)) for p in path if (m := _BLOCK.match(p)))
                attention[block] = _first(value)
            elif key.endswith(("_in", "_out")) and isinstance(_first(value), dict):
                slot, side = key.rsplit("_", 1)
                where = [p for p in path if p != "Transformer"] + [slot]
                stats.setdefault("/".join(where), {})[side] = dict(_first(value))
            elif isinstance(value, dict):
                walk(value, path + (key,))

    walk(scan_convert.unstack_blocks(tree), ())
    return [attention[i] for i in sorted(attention)], stats


def make_analyzer(model: Any, grid: tuple[int, int], patch_size: int,
                  full: bool = False) -> Callable[[dict, Any], dict]:
    """jitted (variables, images) -> {'stats', 'distance', 'cls_maps', ['attention']}."""
    n = grid[0] * grid[1]

    def f(variables, images):
        _, state = model.apply(variables, images, train=False, capture=True,
                               mutable=["intermediates"])
        attention, stats = parse_intermediates(state["intermediates"])
        maps = []
        for a in attention:
            prefix = a.shape[-1] - n
            m = a[:, :, 0, prefix:] if prefix else jnp.mean(a, axis=2)
            maps.append(m.reshape(m.shape[:2] + grid))
        out = {"stats": stats, "cls_maps": maps,
               "distance": jnp.stack([distance.mean_attention_distance(a, grid, patch_size)
                                      for a in attention])}
        if full:
            out["attention"] = attention
        return out

    return jax.jit(f)


def to_analysis(out: dict, has_cls: list[bool]) -> Analysis:
    """The analyzer's device output as numpy/float."""
    out = jax.device_get(out)
    stats = {slot: {side: {k: float(v) for k, v in d.items()} for side, d in sides.items()}
             for slot, sides in out["stats"].items()}
    attention = [np.asarray(a) for a in out["attention"]] if "attention" in out else None
    return Analysis(stats, np.asarray(out["distance"]), [np.asarray(m) for m in out["cls_maps"]],
                    list(has_cls), attention)


_ANALYZERS: dict[tuple[str, bool], Callable] = {}


def config_key(config: ml_collections.ConfigDict, data_spec: DataSpec) -> str:
    """What fixes the float32 model and its input: runs that share it share compiled functions."""
    return json.dumps([config.model.to_dict(), data_spec.num_classes, data_spec.image_shape],
                      sort_keys=True, default=str)


def analyze(run: Run, images: np.ndarray, full: bool = False) -> Analysis:
    """Capture forward of ``run`` on ``images`` (one jitted call, compiled once per model config)."""
    key = (config_key(run.config, run.data), full)
    if key not in _ANALYZERS:
        grid, p = geometry(run.model.spec, run.config.data.image_size)
        _ANALYZERS[key] = make_analyzer(run.model, grid, p, full)
    return to_analysis(_ANALYZERS[key](run.variables, images), run.model.spec.block_has_cls())

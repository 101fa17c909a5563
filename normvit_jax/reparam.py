"""Folds inference-time affine norms into the next linear layer (docs/norms.md, re-parameterization).

In eval mode BatchNorm, UN, LearnableScaler and Rescale compute n(x) = a * x + c per channel (a
norm class says so by having ``inference_affine(params, stats) -> (a, c)``). In a pre-norm ViT
every norm slot feeds one linear map: ``LayerNorm_0`` the query/key/value projections,
``LayerNorm_2`` the MLP's ``Dense_0``, ``encoder_norm`` the ``pre_logits`` or ``head`` Dense (the
class-token pick and the global average pool commute with a per-channel affine). With kernel K
(C_in, ...) and bias b: K' = a[:, None] * K, b' = b + c @ K, and the slot becomes 'identity': the
same function without a pass over the activations (UN's "faster inference").

    python -m normvit_jax.reparam --workdir=runs/demo_un [--out=runs/demo_un/folded]
                                                             # fold, check, time [, save]
    (--weights=ema: a run's weight EMA, recorded in the folder's model.json)

``fold(spec, variables)`` returns the folded model's spec, variables and a report;
``max_logit_difference`` is the equivalence check; ``save``/``load`` write and read a folded
model (``model.json`` + ``variables.msgpack``, local or gs://). RepBN and a progressive norm
evaluating a foldable N2 fold like BN. DyT, Derf, zscore and minmax fold their scale/bias and keep
their point-wise function or token statistics (``split_affine``; the slot keeps the norm with
``affine=False``). PowerNorm (per-token group scaling at inference), LayerNorm and the other
per-token norms do not fold and are kept; the report lists what was folded and what stays.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath
from flax import serialization

from normvit_jax import models, norms
from normvit_jax.models import scan_convert
from normvit_jax.models.spec import FC_CLASSIFIERS, FC_SLOT, FINAL_SLOT, ViTSpec
from normvit_jax.models.t2t_vit import STEM_SCOPE, T2TViTSpec

ATTENTION = "MultiHeadDotProductAttention_1"
# Slot of a block -> the linear layers it feeds (paths inside the block).
NEXT_LAYERS = {"LayerNorm_0": ((ATTENTION, "query"), (ATTENTION, "key"), (ATTENTION, "value")),
               "LayerNorm_2": (("MlpBlock_3", "Dense_0"),)}


# Where a slot sits, by its parameter name (Google's layout names a slot LayerNorm_* whatever it holds).
_ROLES = {"LayerNorm_0": "before attention", "LayerNorm_2": "before the MLP",
          FINAL_SLOT: "final norm", FC_SLOT: "final norm", "norm1": "stem, before attention",
          "norm2": "stem, before the MLP"}


@dataclasses.dataclass
class FoldReport:
    """folded: slot paths folded into their next layer; kept: (slot path, why it stays);
    norms: slot path -> the name of the norm in it (the path's 'LayerNorm_0' is only a name)."""

    folded: list[str] = dataclasses.field(default_factory=list)
    kept: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    norms: dict[str, str] = dataclasses.field(default_factory=dict)

    def _slot(self, path: str) -> str:
        """'repbn (before attention) at Transformer/encoderblock_0/LayerNorm_0'."""
        role = _ROLES.get(path.rsplit("/", 1)[-1])
        name = self.norms.get(path, "")
        what = " ".join(x for x in (name, f"({role})" if role else "") if x)
        return f"{what} at {path}" if what else path

    def __str__(self) -> str:
        lines = [f"folded {len(self.folded)} norm slot(s) into the next Dense"]
        lines += [f"  folded {self._slot(s)}" for s in self.folded]
        lines += [f"  kept   {self._slot(s)}: {why}" for s, why in self.kept]
        return "\n".join(lines)


def _plain(tree: Any) -> Any:
    """A mutable nested dict of numpy arrays (from FrozenDict / ConfigDict / jax arrays)."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return np.asarray(tree)


def _fold_into(layer: dict, a: np.ndarray, c: np.ndarray) -> None:
    """kernel (C, *out), bias (*out) of one Dense <- the affine a * x + c in front of it. A Dense
    without bias (``qkv_bias=False``) gets one."""
    k = layer["kernel"].astype(np.float64)
    a64, c64 = a.astype(np.float64), c.astype(np.float64)
    bias = layer.get("bias", np.zeros(k.shape[1:])).astype(np.float64) + np.tensordot(c64, k, axes=(0, 0))
    layer["kernel"] = (a64.reshape(a64.shape + (1,) * (k.ndim - 1)) * k).astype(np.float32)
    layer["bias"] = bias.astype(np.float32)


def _affine(norm_cfg: Any, slot_params: Mapping, slot_stats: Mapping, dim: int):
    module = norms.create(norm_cfg, dim=dim, slot="fold")
    a, c = module.inference_affine(slot_params, slot_stats)
    return np.asarray(a, np.float32), np.asarray(c, np.float32)


def _slot_fold(norm_cfg: Any, slot_params: Mapping, slot_stats: Mapping, dim: int):
    """(a, c, the slot's config after the fold, its params after the fold) of one slot: a whole
    affine norm becomes 'identity'; a norm with ``split_affine`` (DyT, Derf, zscore, minmax) keeps
    its point-wise function or statistics with ``affine=False`` and gives its scale/bias."""
    if foldable(norm_cfg):
        a, c = _affine(norm_cfg, slot_params, slot_stats, dim)
        return a, c, {"name": "identity"}, {}
    module = norms.create(norm_cfg, dim=dim, slot="fold")
    a, c, opts, kept = module.split_affine(slot_params, slot_stats)
    cfg = {**norms.as_dict(norm_cfg), **opts}
    return np.asarray(a, np.float32), np.asarray(c, np.float32), cfg, _plain(kept)


def _why_kept(norm_cfg: Any) -> str:
    """Why a slot stays: the norm class's ``NOT_FOLDED`` text, or what it lacks."""
    name = norms.name_of(norm_cfg)
    cls = norms.resolve(name)
    if getattr(cls, "NOT_FOLDED", None):
        return f"{name}: {cls.NOT_FOLDED}"
    if hasattr(cls, "inference_affine"):
        return f"{name}: {cls.__name__}.folds says this configuration is not a fixed affine"
    return (f"{name}: {cls.__name__} has no inference_affine(params, stats) (its eval output is "
            "not declared a fixed per-channel affine)")


def _why_split(norm_cfg: Any) -> str:
    name = norms.name_of(norm_cfg)
    what = getattr(norms.resolve(name), "SPLIT_KEEPS", None) or "the rest of the norm"
    return f"{name}: scale/bias folded, {what} stays"


def foldable(norm_cfg: Any) -> bool:
    """Whether the slot's eval function is a fixed per-channel affine (folds away entirely)."""
    cls = norms.resolve(norms.name_of(norm_cfg))
    if not hasattr(cls, "inference_affine"):
        return False
    opts = norms.as_dict(norm_cfg)
    return cls.folds(opts) if hasattr(cls, "folds") else True


def splittable(norm_cfg: Any) -> bool:
    """Whether the slot's scale/bias fold while its function stays (``split_affine``)."""
    cls = norms.resolve(norms.name_of(norm_cfg))
    return hasattr(cls, "split_affine") and norms.as_dict(norm_cfg).get("affine", True)


def fold(model: Any, variables: Mapping[str, Any]) -> tuple[ViTSpec, dict, FoldReport]:
    """(folded model's spec, folded variables, report) of a model (its ``ViTSpec`` or
    ``config.model``). The inputs are left unchanged.

    Works on either block layout (``model.scan``); the result has the layout of the folded spec.
    Raises ValueError for post-norm or sandwich placements (there a norm feeds the residual
    stream, not one Dense).
    """
    spec = models.spec_of(model)
    placement = spec.norm_placement
    if placement != "pre":
        raise ValueError(f"model.norm_placement={placement!r}: only 'pre' norms fold into the next "
                         "Dense (post and sandwich norms feed the residual stream)")
    flat = scan_convert.unstack_blocks(_plain(variables))
    params, stats = flat["params"], flat.get("batch_stats", {})
    tf_params, tf_stats = params["Transformer"], stats.get("Transformer", {})
    dim = spec.hidden_size
    report, new_overrides = FoldReport(), {}
    for i in range(spec.depth):
        ncfg = spec.block_norm(i)
        block = f"encoderblock_{i}"
        if norms.name_of(ncfg) == "identity":
            continue
        report.norms[f"Transformer/{block}"] = norms.name_of(ncfg)
        if not (foldable(ncfg) or splittable(ncfg)):
            report.kept.append((f"Transformer/{block}", _why_kept(ncfg)))
            continue
        for slot, targets in NEXT_LAYERS.items():
            a, c, new_cfg, kept = _slot_fold(ncfg, tf_params[block].get(slot, {}),
                                             tf_stats.get(block, {}).get(slot, {}), dim)
            for path in targets:
                layer = tf_params[block]
                for key in path:
                    layer = layer[key]
                _fold_into(layer, a, c)
            tf_params[block].pop(slot, None)
            if kept:
                tf_params[block][slot] = kept
            if block in tf_stats:
                tf_stats[block].pop(slot, None)
            report.folded.append(f"Transformer/{block}/{slot}")
            report.norms[f"Transformer/{block}/{slot}"] = norms.name_of(ncfg)
            if new_cfg["name"] != "identity":
                report.kept.append((f"Transformer/{block}/{slot}", _why_split(ncfg)))
        new_overrides[f"block_{i}"] = new_cfg
    _fold_final(spec, params, stats, dim, report, new_overrides)
    # 'block_<i>' is the narrowest key, so it wins over any range that also covers block i.
    new_spec = spec.with_norm_overrides(new_overrides)
    if any(k.startswith("block_") for k in new_overrides) and not spec.qkv_bias:
        new_spec = dataclasses.replace(new_spec, qkv_bias=True)  # the fold gave them a bias
    if isinstance(spec, T2TViTSpec) and _fold_stem(spec, params, stats, report):
        new_spec = dataclasses.replace(new_spec, stem_norm={"name": "identity"})
    out = {"params": params}
    if jax.tree.leaves(stats):
        out["batch_stats"] = stats
    return new_spec, scan_convert.to_layout(out, new_spec), report


def _fold_final(spec: Any, params: dict, stats: dict, dim: int, report: FoldReport,
                new_overrides: dict) -> None:
    """The final norm ('Transformer/encoder_norm', or the top-level 'fc_norm' of classifiers
    'gap_fc_norm' and 'token_gap_fc_norm') into the ``pre_logits`` or ``head`` Dense."""
    if spec.classifier in FC_CLASSIFIERS:
        p_scope, s_scope, key, path = params, stats, FC_SLOT, FC_SLOT
    else:
        p_scope, s_scope = params["Transformer"], stats.get("Transformer", {})
        key, path = FINAL_SLOT, f"Transformer/{FINAL_SLOT}"
    cfg = spec.final_norm_config()
    if not spec.final_norm or not (key in p_scope or key in s_scope):
        return
    if norms.name_of(cfg) == "identity":
        return
    report.norms[path] = norms.name_of(cfg)
    if not (foldable(cfg) or splittable(cfg)):
        report.kept.append((path, _why_kept(cfg)))
        return
    a, c, new_cfg, kept = _slot_fold(cfg, p_scope.get(key, {}), s_scope.get(key, {}), dim)
    _fold_into(params["pre_logits" if spec.representation_size else "head"], a, c)
    p_scope.pop(key, None)
    s_scope.pop(key, None)
    if kept:
        p_scope[key] = kept
    new_overrides["final"] = new_cfg
    report.folded.append(path)
    if new_cfg["name"] != "identity":
        report.kept.append((path, _why_split(cfg)))


def _fold_stem(spec: Any, params: dict, stats: dict, report: FoldReport) -> bool:
    """T2T-ViT's stem (models/t2t_vit.py): in each Performer layer ``norm1`` feeds ``kqv`` and
    ``norm2`` feeds ``mlp_0``. Returns whether the stem's norms were folded."""
    cfg = spec.stem_norm_config
    report.norms[STEM_SCOPE] = norms.name_of(cfg)
    if not foldable(cfg):
        report.kept.append((STEM_SCOPE, _why_kept(cfg)))
        return False
    if norms.name_of(cfg) == "identity":
        return False
    for layer, p in sorted(params[STEM_SCOPE].items()):
        if not layer.startswith("attention"):
            continue
        st = stats.get(STEM_SCOPE, {}).get(layer, {})
        for slot, target in (("norm1", "kqv"), ("norm2", "mlp_0")):
            a, c = _affine(cfg, p.get(slot, {}), st.get(slot, {}), p[target]["kernel"].shape[0])
            _fold_into(p[target], a, c)
            p.pop(slot, None)
            st.pop(slot, None)
            report.folded.append(f"{STEM_SCOPE}/{layer}/{slot}")
            report.norms[f"{STEM_SCOPE}/{layer}/{slot}"] = norms.name_of(cfg)
    return True


# the patch-embedding stems whose first operation on the pixels is the linear patch projection
_LINEAR_STEMS = ("none", "post", "post_posemb")


def fold_input_affine(model: Any, variables: Mapping[str, Any], scale: np.ndarray,
                      shift: np.ndarray) -> dict | None:
    """The variables of a model that takes pixels ``x`` where it took ``x * scale + shift`` (the
    run's input affine, per channel): the affine moved into the patch embedding, kernel K (p, p,
    C, D) -> K * scale[c], bias -> bias + sum K * shift[c], so a deployed graph normalizes
    nothing itself. None where the stem does not start with that linear map (T2T-ViT's
    unfolding attention; a norm on the raw patches, ``patch_norm`` 'pre'/'dual'). Computed in
    float64. The inputs are left unchanged."""
    spec = models.spec_of(model)
    if isinstance(spec, T2TViTSpec) or spec.patch_norm not in _LINEAR_STEMS:
        return None
    out = _plain(variables)  # new containers
    emb = out["params"]["embedding"]
    k = np.asarray(emb["kernel"], np.float64)
    scale, shift = (np.asarray(a, np.float64).reshape(-1) for a in (scale, shift))
    emb["kernel"] = (k * scale[None, None, :, None]).astype(np.float32)
    emb["bias"] = (np.asarray(emb["bias"], np.float64)
                   + np.einsum("pqcd,c->d", k, shift)).astype(np.float32)
    return out


def _eval_logits(model: Any, variables: Mapping, images: jax.Array,
                 num_classes: int) -> jax.Array:
    return models.create(model, num_classes).apply(variables, images, train=False)


def max_logit_difference(model: Any, variables: Mapping, folded: Any,
                         folded_variables: Mapping, images: jax.Array, num_classes: int) -> float:
    """max |logits(model) - logits(folded model)| in eval mode on ``images``."""
    a = _eval_logits(model, variables, images, num_classes)
    b = _eval_logits(folded, folded_variables, images, num_classes)
    return float(jnp.max(jnp.abs(a - b)))


def save(path: str, model: Any, variables: Mapping, num_classes: int,
         source: Mapping[str, Any] | None = None) -> None:
    """Writes a folded model (its spec or ``config.model``) to the folder ``path``:
    ``variables.msgpack`` and ``model.json`` ({'model': config, 'num_classes': n, and with
    ``source`` where the weights came from: {'workdir', 'step', 'weights': 'raw'|'ema', ...}, so
    a folder folded from a run's EMA is not taken for its raw weights}), each written
    to a temporary name, then renamed over an earlier save's. An earlier ``model.json`` is removed
    first and the new one is written last, so a save that stops part-way (Ctrl-C, a full disk)
    leaves a folder ``load`` refuses, never new weights read with another model's config."""
    model_cfg = models.spec_of(model).to_config()
    d = epath.Path(path)
    d.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(
        {"model": json.loads(ml_collections.ConfigDict(dict(model_cfg)).to_json_best_effort()),
         "num_classes": int(num_classes), **({"source": dict(source)} if source else {})},
        indent=2)
    if (d / "model.json").exists():
        (d / "model.json").unlink()
    # rename() refuses an existing file (a re-run's --out): replace()
    for name, data in (("variables.msgpack", serialization.msgpack_serialize(
            jax.tree.map(np.asarray, dict(variables)))), ("model.json", meta.encode())):
        tmp = d / f"{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(d / name)


def source_of(path: str) -> dict:
    """The ``source`` a folder's model.json records (``save``); {} for a folder written before
    it did (its weights were the raw ones: the tools had no --weights then)."""
    try:
        source = json.loads((epath.Path(path) / "model.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):  # load() names a missing or damaged file
        return {}
    return dict(source) if isinstance(source, dict) else {}


def load(path: str) -> tuple[dict, dict, int]:
    """(model config, variables, num_classes) of a folder written by ``save``:
    ``models.create(cfg, num_classes).apply(variables, images)``."""
    d = epath.Path(path)
    for name in ("model.json", "variables.msgpack"):
        if not (d / name).exists():
            raise FileNotFoundError(f"{d / name} not found: is {path} a folder written by "
                                    "normvit_jax.reparam.save (or the CLI's --out)?")
    redo = "write the folder again: python -m normvit_jax.reparam --workdir=RUN --out=" + str(path)
    try:
        meta = json.loads((d / "model.json").read_text())
        model_cfg, num_classes = meta["model"], int(meta["num_classes"])
    except (ValueError, KeyError, TypeError) as e:  # JSON's message alone named no file
        raise ValueError(f"{d / 'model.json'} is damaged ({type(e).__name__}: {e}); "
                         f"{redo}") from None
    try:
        variables = serialization.msgpack_restore((d / "variables.msgpack").read_bytes())
    except Exception as e:  # noqa: BLE001 msgpack's 'Unpack failed: incomplete input' named no file
        raise ValueError(f"{d / 'variables.msgpack'} is damaged ({type(e).__name__}: {e}); "
                         f"{redo}") from None
    return model_cfg, variables, num_classes


def _time(fn, variables, images, reps: int) -> list[float]:
    jax.block_until_ready(fn(variables, images))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(variables, images))
        ts.append(time.perf_counter() - t)
    return ts


MIN_REPS_FOR_RATIO = 3  # timings per model before their spreads are compared


def timing_summary(unfolded: Sequence[float], folded: Sequence[float] | None, batch: int) -> str:
    """Medians with their min-max spread; a ratio only when something was folded, each model was
    timed at least ``MIN_REPS_FOR_RATIO`` times and the spreads do not overlap (otherwise the
    difference is timing noise)."""
    def fmt(ts):
        return f"{np.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"
    if folded is None:
        return (f"eval batch of {batch}: {fmt(unfolded)}, median of {len(unfolded)}; nothing was "
                "folded, so the folded model is the same model (no speed ratio)")
    ratio = float(np.median(unfolded) / np.median(folded))
    overlap = min(unfolded) <= max(folded) and min(folded) <= max(unfolded)
    if min(len(unfolded), len(folded)) < MIN_REPS_FOR_RATIO:
        # one or two timings have no spread to speak of: --reps=1 claimed "10x as fast" from noise
        verdict = (f"too few repetitions to tell a difference from noise (--reps of at least "
                   f"{MIN_REPS_FOR_RATIO} gives a ratio)")
    elif overlap:
        verdict = "the spreads overlap: no measurable difference"
    else:
        verdict = f"folded {ratio:.2f}x as fast"
    return (f"eval batch of {batch}: unfolded {fmt(unfolded)}, folded {fmt(folded)}, median of "
            f"{len(unfolded)}; {verdict}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Folds a run's checkpoint, checks the logits on random images and times both models."""
    from normvit_jax import cli, logs, tool_flags

    logs.quiet_library_logs()
    p = tool_flags.Parser("python -m normvit_jax.reparam", __doc__)
    p.add_argument("--workdir", required=True, help="run directory with checkpoints")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    tool_flags.add_weights(p)
    p.add_argument("--batch", type=tool_flags.positive_int, default=64,
                   help="images for the check and the timing")
    p.add_argument("--reps", type=tool_flags.positive_int, default=5,
                   help="timed repetitions (median; a speed ratio needs at least 3)")
    p.add_argument("--out", default=None,
                   help="folder to save the folded model in (model.json + variables.msgpack; "
                        "read back with normvit_jax.reparam.load)")
    args = p.parse_args(argv)
    with cli.tool_errors(p.prog):  # docs/faults.md: one line and the table's exit code
        return _main(args)


def _main(args: Any) -> dict[str, Any]:
    from normvit_jax import checkpoints, tool_flags
    if args.out:
        tool_flags.check_output("out", args.out, folder=True)  # before the work
    # the shared restore, the raw or EMA weights (--weights), recorded in model.json
    variables, config, source = checkpoints.restore_weights(args.workdir, args.step, args.weights)
    num_classes = int(variables["params"]["head"]["bias"].shape[-1])
    size = int(config.data.image_size)
    images = jax.random.normal(jax.random.key(0), (args.batch, size, size, 3))
    folded_spec, folded, report = fold(config.model, variables)
    print(report)
    want = _eval_logits(config.model, variables, images, num_classes)
    diff = float(jnp.max(jnp.abs(_eval_logits(folded_spec, folded, images, num_classes) - want)))
    scale = float(jnp.max(jnp.abs(want)))
    print(f"max |logit difference| on {args.batch} random images: {diff:.3g} "
          f"(largest |logit| {scale:.3g})")
    run = lambda c: jax.jit(lambda v, x: models.create(c, num_classes).apply(v, x, train=False))
    ts0 = _time(run(config.model), variables, images, args.reps)
    ts1 = _time(run(folded_spec), folded, images, args.reps) if report.folded else None
    print(timing_summary(ts0, ts1, args.batch))
    t0 = float(np.median(ts0))
    t1 = float(np.median(ts1)) if ts1 else t0
    if args.out:
        save(args.out, folded_spec, folded, num_classes,
             {"workdir": str(args.workdir), **source})
        print(f"folded model of the {source['weights']} weights of step {source['step']} saved "
              f"in {args.out}")
    return {"folded": report.folded, "kept": report.kept, "max_diff": diff, "unfolded_s": t0,
            "folded_s": t1}


if __name__ == "__main__":
    from normvit_jax import logs as _logs  # absl's log format, as main.py's
    _logs.absl_format()
    main()

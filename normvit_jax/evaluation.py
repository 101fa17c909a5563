"""Evaluation of a saved checkpoint without training (``main.py --mode=eval``).

Any split of any evaluation set: ``config.data.eval_name`` picks the tfds dataset (None: the
training set's; 'imagenet_v2' split 'test'; 'imagenet2012_real' split 'validation'), and
``config.data.eval_split`` the split. Top-1, top-5 and loss as the training loop's eval (the same
masked means over the real rows), plus ReaL top-1 for 'imagenet2012_real' (Beyer et al. 2020, "Are
we done with ImageNet?": a prediction is right if it is in the image's set of ReaL labels; images
whose set is empty are left out). The EMA weights are evaluated too when the run keeps them.
Per class (``per_class.py``, from the same forward pass): each class's top-1, the most frequent
mistakes and the confusion matrix, drawn as ``eval_<dataset>_<split>_confusion_<step>.png``.
The metrics go to ``<workdir>/eval_<dataset>_<split>_<step>.json`` (written atomically; training
moves them and the picture with a damaged checkpoint of that step, ``--fresh`` with the rest of
the run).
"""
from __future__ import annotations

import dataclasses

import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from etils import epath

from normvit_jax import (checkpoints, data, distributed, per_class, run_config, run_data,
                         sharding)
from normvit_jax.train import evaluator, setup
from normvit_jax.train import optimizer as optim


def real_top1_counts(logits: jax.Array, real: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hits, counted) for ReaL top-1: ``real`` (B, classes) multi-hot label sets; a row counts if
    it is a real row (``mask``) with a non-empty set, and hits if its argmax is in the set."""
    pred = jnp.argmax(logits, -1)
    counted = (mask > 0) & jnp.any(real > 0, -1)
    hit = jnp.take_along_axis(real, pred[:, None], axis=-1)[:, 0] > 0
    return jnp.sum(hit & counted), jnp.sum(counted)


def real_sums(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
    """The eval step's extra sums: ``{'real_hits', 'real_count'}`` for an ImageNet-ReaL batch (one
    that carries 'real'; decided when the step is traced), else {}."""
    if "real" not in batch:
        return {}
    hits, counted = real_top1_counts(logits, batch["real"], batch["mask"])
    return {"real_hits": hits, "real_count": counted}


def _with_real_top1(metrics: dict[str, Any]) -> dict[str, Any]:
    """Turns the summed ReaL counts (raw and ``ema_``) into ``real_top1`` and its example count.
    A split where no image has a ReaL label set scores nothing: ``real_top1`` is None (JSON null,
    big_vision's evaluator gives NaN there) and one warning says why, rather than a 0.0 that reads
    as a model that is always wrong."""
    for p in ("", "ema_"):
        if f"{p}real_count" in metrics:
            hits, count = metrics.pop(f"{p}real_hits"), metrics.pop(f"{p}real_count")
            metrics[f"{p}real_top1"] = hits / count if count > 0 else None
            metrics[f"{p}real_num_examples"] = int(count)
    if metrics.get("real_num_examples") == 0:
        logging.warning("ReaL top-1: no image of this split has a ReaL label set (ReaL leaves "
                        "some ImageNet images without one), so none is scored: real_top1 is null.")
    return metrics


def result_path(workdir: str, data_spec: data.DataSpec, step: int,
                changed_model: bool = False) -> epath.Path:
    """``eval_<dataset>_<split>_<step>.json``; ``changed_model`` (an eval with model keys changed
    under allow_config_change): ``eval_<dataset>_<split>_changed-model_<step>.json``, never the
    run's own file (it still ends in ``_<step>.json``: it moves with a damaged checkpoint)."""
    name = f"{data_spec.eval_name}_{data_spec.eval_split}"
    tag = "_changed-model" if changed_model else ""
    return (epath.Path(workdir)
            / f"eval_{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}{tag}_{step}.json")


# model.* keys an eval may change without evaluating another function of the checkpoint: how
# attention, the backward or the layout is computed, the train-only regularisers, and the
# initialisation (the checkpoint replaces every parameter).
EVAL_NEUTRAL_MODEL_KEYS = ("model.attention_impl", "model.fusion_barriers", "model.recompute",
                           "model.stream_layout", "model.scan", "model.dropout_rate",
                           "model.attention_dropout_rate", "model.stochastic_depth",
                           "model.param_init")
# a norm's options (model.norm.<opt>, model.norm_overrides.<slot>.<opt>) of the same kind
EVAL_NEUTRAL_NORM_OPTIONS = run_config.IMPLEMENTATION_NORM_OPTIONS


def _eval_neutral(key: str) -> bool:
    return key in EVAL_NEUTRAL_MODEL_KEYS or run_config.is_norm_implementation_key(key)


def model_changes(config: ml_collections.ConfigDict, workdir: str) -> dict[str, list]:
    """``{key: [the run's value, this config's]}`` for each ``model.*`` key that differs from
    the run's config.json (a key the run's older config.json lacks counts only when it is not at
    its default), less the ``_eval_neutral`` ones; {} without a config.json."""
    path = epath.Path(workdir) / run_config.CONFIG_NAME
    if not path.exists():
        return {}
    saved = run_config.flat_values(ml_collections.ConfigDict(run_config.read_saved(path)))
    current = run_config.flat_values(config)
    defaults: dict | None = None
    out = {}
    for key in sorted(set(saved) | set(current)):
        if not key.startswith("model.") or _eval_neutral(key) or saved.get(key) == current.get(key):
            continue
        if key not in saved or key not in current:  # absent on one side: at its default, no change
            if defaults is None:
                from configs import default  # pylint: disable=import-outside-toplevel
                defaults = run_config.flat_values(default.get_config())
            there = current if key in current else saved
            default_value = _norm_option_default(key, there, defaults.get(key, _NO_DEFAULT))
            if default_value is not _NO_DEFAULT and there[key] == default_value:
                continue
        out[key] = [saved.get(key, "<absent>"), current.get(key, "<absent>")]
    return out


_NO_DEFAULT = object()


def _norm_option_default(key: str, flat: dict, fallback: Any) -> Any:
    """The default of ``key``: for a norm's option ('model.norm.epsilon',
    'model.norm_overrides.final.epsilon') its norm class's field default (the norm named beside
    it in ``flat``), else ``fallback`` (configs/default.py's value). A run trained with
    ``--config.model.norm.epsilon=1e-6`` (LayerNorm's default) and evaluated with a config file
    that does not name it computes the same function."""
    prefix, _, option = key.rpartition(".")
    name = flat.get(f"{prefix}.name") if prefix.startswith(("model.norm", "model.stem_norm")) \
        else None
    if not isinstance(name, str):
        return fallback
    from normvit_jax.norms import registry  # pylint: disable=import-outside-toplevel
    try:
        fields = {f.name: f.default for f in dataclasses.fields(registry.resolve(name))}
    except (ValueError, TypeError):  # an unknown norm or no dataclass: the checks name it
        return fallback
    value = fields.get(option, dataclasses.MISSING)
    return fallback if value is dataclasses.MISSING else value


def _describe_changes(changes: dict[str, list]) -> str:
    items = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()]
    return "; ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


def check_eval_model(config: ml_collections.ConfigDict, workdir: str) -> dict[str, list]:
    """``--mode=eval`` with a model that is not the run's: the checkpoint loads into it whenever
    the arrays keep their shapes (``--config.model.norm.epsilon=0.5``: top-1 0.34 instead of
    0.96, written over the run's eval file). ConfigChangedError (exit 2) naming the keys, unless
    ``config.allow_config_change``: then one warning, and the returned changes name the result
    file (``result_path(changed_model=True)``)."""
    changes = model_changes(config, workdir)
    if not changes:
        return {}
    if not config.get("allow_config_change"):
        raise run_config.ConfigChangedError(
            f"--mode=eval: this config's model is not the run's: {_describe_changes(changes)} "
            f"(its config.json in {workdir}); the checkpoint would be evaluated as another "
            f"model: leave out those overrides (only {', '.join(EVAL_NEUTRAL_MODEL_KEYS)} and "
            f"the norms' {', '.join(EVAL_NEUTRAL_NORM_OPTIONS)} may differ), or pass "
            f"--config.allow_config_change=True to evaluate it so (written to "
            f"eval_<dataset>_<split>_changed-model_<step>.json, not the run's own file)")
    logging.warning("Evaluating %s with a model that is not the run's (allow_config_change): %s; "
                    "the result goes to eval_<dataset>_<split>_changed-model_<step>.json",
                    workdir, _describe_changes(changes))
    return changes


def _require_checkpoint(workdir: str, step: int | None) -> None:
    """RunNotFoundError (exit 2) for a workdir with no run or no checkpoint (of ``step``)."""
    checkpoints.check_checkpoint_dir(workdir)  # a file, a link loop: not "has not saved one yet"
    if not checkpoints.checkpoint_dir(workdir).exists():
        checkpoints.require_run(workdir)  # no run at all: not "continue it with its config.json"
        raise checkpoints.no_checkpoint(workdir)
    steps = checkpoints.complete_steps(workdir)
    if step is not None and step not in steps:
        raise checkpoints.no_checkpoint(workdir, step, steps)


def _with_model_diff(error: Exception, config: ml_collections.ConfigDict, workdir: str
                     ) -> Exception:
    """A checkpoint that does not fit the model: when this config's model differs from the run's
    config.json, say in which keys (the arrays' list alone left the user to find the cause)."""
    path = epath.Path(workdir) / run_config.CONFIG_NAME
    if not path.exists():
        return error
    try:
        diff = run_config.config_diff(run_config.read_saved(path),
                                      json.loads(config.to_json_best_effort()))
    except Exception:  # noqa: BLE001  (a damaged config.json: the mismatch itself still stands)
        return error
    model = [line.strip() for line in diff if line.strip().startswith("model.")]
    if not model:
        return error
    return checkpoints.CheckpointMismatchError(
        f"this config's model is not the run's: {'; '.join(model[:6])}"
        + (f" and {len(model) - 6} more" if len(model) > 6 else "")
        + f" (its config.json in {workdir}); leave out --config to evaluate with the run's own, "
          f"or undo those overrides. {error}")


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None) -> dict[str, Any]:
    """Evaluates checkpoint ``step`` (None: the newest) of ``workdir`` on the config's
    eval set; logs the metrics, then writes and returns ``{'step', 'dataset', 'split', 'metrics',
    'path'}`` (EMA metrics as ``ema_*``; path None when the workdir cannot be written). Raises
    CheckpointMismatchError when the config builds another model and
    checkpoints.RunNotFoundError when there is no checkpoint (of that step)."""
    failure, changes = None, {}
    try:  # checks that may fail on some processes only: they agree before any collective
        # before the dataset is opened: a config file without the run's --config.data.* overrides
        # named another dataset ("not prepared"), not the one the run trained on
        run_config.check_eval_dataset(config, workdir)
        changes = check_eval_model(config, workdir)  # before anything is built or opened
        mesh = sharding.make_mesh(config)  # the run's mesh: an FSDP state is restored sharded
        run_spec = setup.resolve_config(config, mesh.devices.size)
        # the statistics the run trained with (a dataset prepared again since: one warning)
        ds = run_data.inference_spec(workdir, run_spec.data)
        _require_checkpoint(workdir, step)  # before the eval split is opened (it may be decoded)
        pipeline = data.make_pipeline(config, "eval", ds)
    except Exception as e:  # noqa: BLE001  (re-raised by agree, here or on every process)
        failure = e
    distributed.agree("the evaluation's checks", failure)
    model = setup.create_model(config, ds.num_classes, run_spec.model)
    tx, _ = optim.create(config, max(int(config.total_steps or 0), 1))  # only its state's tree
    abstract, state_sharding = setup.abstract_train_state(model, tx, pipeline.image_shape, mesh,
                                                          sharding.fsdp_min_size(config))
    mngr = checkpoints.open_read_only(workdir)  # the run may still be training
    try:
        if step is not None and step not in mngr.all_steps():
            raise checkpoints.no_checkpoint(workdir, step, sorted(mngr.all_steps()))
        # the newest readable one (a damaged newer one is named in a warning and left in place)
        try:
            restored = checkpoints.restore_latest(
                mngr, abstract, move_damaged=False, steps=None if step is None else [step],
                others=None if step is None else [s for s in mngr.all_steps() if s != step])
        except checkpoints.CheckpointMismatchError as e:
            raise _with_model_diff(e, config, workdir) from None
        if restored is None:
            raise checkpoints.no_checkpoint(workdir)
        state, step = restored.state, restored.step
    finally:
        mngr.close()
    # the training loop's eval step and metrics, EMA included, + ReaL top-1 on ImageNet-ReaL
    # and the per-class counts from the same forward pass
    eval_step = setup.jit_eval_step(model, state_sharding, mesh, ds.affine, _extra_sums)
    metrics = _with_real_top1(setup.evaluate(eval_step, state, pipeline, mesh))
    pipeline.close()
    counts = per_class.pop_counts(metrics)
    path = result_path(workdir, ds, step, changed_model=bool(changes))
    result = {"step": int(step), "dataset": ds.eval_name, "split": ds.eval_split,
              "metrics": metrics, "path": str(path)}
    names = per_class.class_names(workdir, ds, ds.num_classes)
    for prefix, c in counts.items():  # 'per_class', and 'ema_per_class' for the EMA weights
        result[f"{prefix}per_class"] = per_class.summarize(c, names)
    if changes:  # the file says which model it describes
        result["model_changes"] = changes
    logging.info("eval of step %d on %s:%s: %s", step, result["dataset"], ds.eval_split,
                 ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in sorted(metrics.items())))
    if "per_class" in result:
        logging.info("eval of step %d: %s", step, per_class.describe(result["per_class"]))
    note = evaluator.nonfinite_warning(metrics, step, workdir, state.batch_stats)
    if note:  # still written and exit 0: the file says what the checkpoint gives
        logging.warning(note)
    if jax.process_index() == 0:  # after the metrics are shown: a read-only workdir loses nothing
        try:
            _write_pictures(result, path, workdir, step, ds)
            # atomic: an eval killed while writing leaves the previous result (or none), never
            # a half file beside the checkpoint it claims to describe
            tmp = path.parent / (path.name + ".tmp")
            tmp.write_text(result_json(result) + "\n")
            tmp.replace(path)
        except OSError as e:
            logging.warning("Could not write %s (%s); the metrics are printed here only.", path,
                            checkpoints.describe_error(e, 200))
            result["path"] = None
            for prefix in counts:
                result[f"{prefix}per_class"].pop("picture", None)
    return result


def result_json(result: dict[str, Any]) -> str:
    """The result file's text: indented, with each list of numbers on one line (the confusion
    matrix of 100 classes was 10,000 lines of one number)."""
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m[1].split(",")) + "]",
                            json.dumps(result, indent=1, sort_keys=True))


_NUMBER_LIST = re.compile(r"\[((?:\s*(?:-?[0-9][0-9.eE+-]*|null)\s*,)*\s*(?:-?[0-9][0-9.eE+-]*|null)\s*)\]")


def _extra_sums(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
    return {**real_sums(logits, batch), **per_class.sums(logits, batch)}


def _write_pictures(result: dict[str, Any], path: epath.Path, workdir: str, step: int,
                    ds: data.DataSpec) -> None:
    """The confusion-matrix picture of each set of weights evaluated (up to
    per_class.PICTURE_MAX_CLASSES classes), its path in the result as ``per_class.picture``."""
    for prefix in ("", "ema_"):
        pc = result.get(f"{prefix}per_class")
        if pc is None:
            continue
        top1 = result["metrics"][f"{prefix}top1"]
        title = (f"{epath.Path(workdir).name} step {step}"
                 + (" (EMA weights)" if prefix else "")
                 + f" on {ds.eval_name}:{ds.eval_split}: top-1 {top1:.2%} of "
                   f"{result['metrics'][f'{prefix}num_examples']} images")
        where = per_class.picture_path(path, prefix)
        try:
            drawn = per_class.picture(pc, title, where)
        except OSError:  # the workdir cannot be written: the result file's handler says so
            raise
        except Exception as e:  # noqa: BLE001  (a picture never costs the eval's result file)
            logging.warning("Could not draw the confusion matrix %s (%s); the result file "
                            "holds the matrix.", where, checkpoints.describe_error(e, 200))
            drawn = False
        if drawn:
            pc["picture"] = str(where)
            if not prefix:
                logging.info("Confusion matrix of step %d: %s", step, where)

"""Evaluation of a saved checkpoint without training (``main.py --mode=eval``).

Any split of any evaluation set: ``config.data.eval_name`` picks the tfds dataset (None: the
training set's; 'imagenet_v2' split 'test'; 'imagenet2012_real' split 'validation'), and
``config.data.eval_split`` the split. Top-1, top-5 and loss as the training loop's eval (the same
masked means over the real rows), plus ReaL top-1 for 'imagenet2012_real' (Beyer et al. 2020, "Are
we done with ImageNet?": a prediction is right if it is in the image's set of ReaL labels; images
whose set is empty are left out). The EMA weights are evaluated too when the run keeps them.
The metrics go to ``<workdir>/eval_<dataset>_<split>_<step>.json`` (written atomically; training
moves them with a damaged checkpoint of that step, ``--fresh`` with the rest of the run).
"""
from __future__ import annotations

import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from etils import epath

from normvit_jax import checkpoints, data, distributed, run_config, run_data, sharding
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


def result_path(workdir: str, data_spec: data.DataSpec, step: int) -> epath.Path:
    name = f"{data_spec.eval_name}_{data_spec.eval_split}"
    return epath.Path(workdir) / f"eval_{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}_{step}.json"


def _require_checkpoint(workdir: str, step: int | None) -> None:
    """RunNotFoundError (exit 2) for a workdir with no run or no checkpoint (of ``step``)."""
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
    failure = None
    try:  # checks that may fail on some processes only: they agree before any collective
        # before the dataset is opened: a config file without the run's --config.data.* overrides
        # named another dataset ("not prepared"), not the one the run trained on
        run_config.check_eval_dataset(config, workdir)
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
            restored = checkpoints.restore_latest(mngr, abstract, move_damaged=False,
                                                  steps=None if step is None else [step])
        except checkpoints.CheckpointMismatchError as e:
            raise _with_model_diff(e, config, workdir) from None
        if restored is None:
            raise checkpoints.no_checkpoint(workdir)
        state, step = restored.state, restored.step
    finally:
        mngr.close()
    # the training loop's eval step and metrics, EMA included, + ReaL top-1 on ImageNet-ReaL
    # from the same forward pass
    eval_step = setup.jit_eval_step(model, state_sharding, mesh, ds.affine, real_sums)
    metrics = _with_real_top1(setup.evaluate(eval_step, state, pipeline, mesh))
    pipeline.close()
    path = result_path(workdir, ds, step)
    result = {"step": int(step), "dataset": ds.eval_name, "split": ds.eval_split,
              "metrics": metrics, "path": str(path)}
    logging.info("eval of step %d on %s:%s: %s", step, result["dataset"], ds.eval_split,
                 ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in sorted(metrics.items())))
    note = evaluator.nonfinite_warning(metrics, step, workdir, state.batch_stats)
    if note:  # still written and exit 0: the file says what the checkpoint gives
        logging.warning(note)
    if jax.process_index() == 0:  # after the metrics are shown: a read-only workdir loses nothing
        try:
            # atomic: an eval killed while writing leaves the previous result (or none), never
            # a half file beside the checkpoint it claims to describe
            tmp = path.parent / (path.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            tmp.replace(path)
        except OSError as e:
            logging.warning("Could not write %s (%s); the metrics are printed here only.", path,
                            checkpoints.describe_error(e, 200))
            result["path"] = None
    return result

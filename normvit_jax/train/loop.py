"""The one generic training loop: every model size and every normalizer goes through here."""
from __future__ import annotations

import json
import os
import math
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions
from etils import epath

from normvit_jax import checkpoints, data, models, sharding
from normvit_jax.train import optimizer as optim
from normvit_jax.train import steps as steps_lib
from normvit_jax.train.state import TrainState

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
EXIT_PREEMPTED = 42  # main.py's exit code after a SIGTERM-triggered checkpoint
# Keys that may differ between the saved config and a re-run without allow_config_change.
_ALWAYS_CHANGEABLE = ("allow_config_change",)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the message names the step and last checkpoint."""


class PreemptedError(RuntimeError):
    """A SIGTERM arrived; a checkpoint was written at the step named in the message."""


class ConfigChangedError(ValueError):
    """The workdir holds a run made with another config."""


def absolute_workdir(workdir: str) -> str:
    """Orbax needs absolute paths; remote paths (gs://...) are left as they are."""
    workdir = str(workdir)
    return workdir if "://" in workdir else os.path.abspath(workdir)


def total_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
    if config.total_steps:
        return int(config.total_steps)
    return max(1, int(math.ceil(config.num_epochs * steps_per_epoch)))


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> dict:
    """Checks every choice by name and every size constraint before anything is compiled.

    Returns the resolved model config. Raises ValueError naming the key, its value and what is
    accepted.
    """
    data.validate(config)
    model_cfg = models.resolve_model_config(config.model.to_dict())
    models.vit.check_override_keys(model_cfg.get("norm_overrides"), model_cfg["depth"])
    from normvit_jax import norms
    norms.resolve(model_cfg["norm"]["name"])
    for ov in (model_cfg.get("norm_overrides") or {}).values():
        norms.resolve(ov["name"])
    if config.data.image_size % model_cfg["patch_size"]:
        raise ValueError(
            f"config.data.image_size={config.data.image_size} is not divisible by the patch size "
            f"{model_cfg['patch_size']} (model.patch_size / model.variant); accepted: a multiple of "
            f"{model_cfg['patch_size']}")
    optim.validate(config)
    if config.dtype not in DTYPES:
        raise ValueError(f"config.dtype={config.dtype!r} is not accepted; accepted: {list(DTYPES)}")
    n = num_devices or jax.device_count()
    k = config.grad_accum_steps
    if k < 1 or config.batch_size % k:
        raise ValueError(f"config.grad_accum_steps={k} must be >= 1 and divide "
                         f"config.batch_size={config.batch_size}")
    for key, value in (("batch_size", config.batch_size // k), ("eval_batch_size", config.eval_batch_size)):
        if value % n:
            what = "batch_size / grad_accum_steps" if key == "batch_size" and k > 1 else key
            raise ValueError(f"config.{what}={value} is not divisible by the number of devices ({n}); "
                             f"accepted: a multiple of {n}")
    for key in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints"):
        if config[key] < 1:
            raise ValueError(f"config.{key}={config[key]} must be >= 1")
    return model_cfg


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_or_write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes config.json at the first start; refuses a re-run with another config (with a diff)
    unless ``config.allow_config_change``."""
    path = checkpoints.config_path(workdir)
    current = json.loads(config.to_json_best_effort())
    if path.exists():
        saved = json.loads(path.read_text())
        a, b = _flatten(saved), _flatten(current)
        diff = [f"  {k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and k not in _ALWAYS_CHANGEABLE]
        if diff and not config.allow_config_change:
            raise ConfigChangedError(
                f"{workdir} holds a run made with another config; changed keys:\n" + "\n".join(diff)
                + "\nUse another --workdir, or pass --config.allow_config_change=True to continue "
                  "this run with the new values.")
        if not diff:
            return
        logging.warning("Continuing %s with a changed config (allow_config_change):\n%s", workdir,
                        "\n".join(diff))
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text(json.dumps(current, indent=2, sort_keys=True))
        tmp.replace(path)


class _SigtermFlag:
    """Remembers a SIGTERM so the loop can finish the step, checkpoint and exit."""

    def __init__(self):
        self.set = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        logging.warning("SIGTERM received: finishing the step, then checkpointing.")
        self.set = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _preempted(flag: _SigtermFlag, step: int) -> bool:
    if jax.process_count() > 1:  # all hosts agree on the step through JAX's own sync point
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step) or flag.set
    return flag.set


def create_train_state(config, model, tx, image_shape, mesh, rng) -> tuple[TrainState, Any]:
    """Initialises the state directly into its (replicated) sharding; shapes from eval_shape."""
    def init(rng):
        params_rng, state_rng = jax.random.split(rng)
        variables = model.init({"params": params_rng, "dropout": params_rng},
                               jnp.zeros((1,) + tuple(image_shape), jnp.float32), train=False)
        return TrainState.create(variables["params"], variables.get("batch_stats", {}), tx,
                                 jax.random.key_data(state_rng))

    abstract = jax.eval_shape(init, rng)
    state_sharding = jax.tree.map(lambda _: sharding.replicated(mesh), abstract)
    state = jax.jit(init, out_shardings=state_sharding)(rng)
    return state, state_sharding


def evaluate(eval_step, state, pipeline, mesh) -> dict[str, float]:
    """Metrics over the whole eval split (padded rows are masked out)."""
    acc = None
    for batch in pipeline.eval_batches():
        m = eval_step(state, sharding.to_global(batch, mesh))
        acc = m if acc is None else acc.merge(m)
    out = {k: float(v) for k, v in acc.compute().items()}
    out["num_examples"] = int(acc.loss.count)
    return out


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_at: int | None = None) -> dict[str, Any]:
    """Trains and evaluates; re-running with the same workdir continues from the newest checkpoint.

    ``stop_at``: end this process after that step with a checkpoint (the schedule still runs to
    the configured total), for time-sliced jobs; a re-run continues. Returns the final step, the
    last eval metrics and the state.
    """
    mesh = sharding.make_mesh()
    model_cfg = validate_config(config, mesh.devices.size)
    workdir = absolute_workdir(workdir)
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    check_or_write_config(config, workdir)

    train_data = data.make_pipeline(config, "train")
    eval_data = data.make_pipeline(config, "eval")
    num_classes = data.num_classes(config.data.name)
    n_steps = total_steps(config, train_data.steps_per_epoch)
    model = models.create(model_cfg, num_classes, dtype=DTYPES[config.dtype], remat=config.remat)
    tx, lr_schedule = optim.create(config, n_steps)

    rng = jax.random.key(config.seed)
    state, state_sharding = create_train_state(config, model, tx, train_data.image_shape, mesh, rng)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    logging.info("Model: %s, %s parameters; %d devices; %d steps (%d per epoch).",
                 model_cfg.get("variant") or "custom", f"{n_params:,}", mesh.devices.size, n_steps,
                 train_data.steps_per_epoch)

    mngr = checkpoints.make_manager(workdir, keep=config.keep_checkpoints)
    restored, start_step = checkpoints.restore_latest(mngr, state)
    if restored is not None:
        state = restored
        logging.info("Resumed from the checkpoint at step %d in %s.", start_step, mngr.directory)
    else:
        start_step = 0
        if config.init_from:
            state = _init_from_pretrained(config, model_cfg, num_classes, state, tx, state_sharding)

    writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0,
                                                  asynchronous=True)
    if start_step == 0:
        writer.write_hparams({k: v for k, v in _flatten(json.loads(config.to_json_best_effort())).items()
                              if isinstance(v, (int, float, str, bool))})

    rep, bat = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    train_step = jax.jit(
        steps_lib.make_train_step(model, tx, lr_schedule, label_smoothing=config.label_smoothing,
                                  grad_accum_steps=config.grad_accum_steps,
                                  skip_nonfinite=config.skip_nonfinite_steps > 0),
        in_shardings=(state_sharding, bat), out_shardings=(state_sharding, rep), donate_argnums=0)
    eval_step = jax.jit(steps_lib.make_eval_step(model), in_shardings=(state_sharding, bat),
                        out_shardings=rep)

    report = periodic_actions.ReportProgress(num_train_steps=n_steps, writer=writer)
    global_batch = config.batch_size
    eval_metrics: dict[str, Any] = {}
    last_saved = start_step if restored is not None else None
    train_metrics = None
    t_log, step_log = time.time(), start_step
    step = start_step
    batches = train_data.train_batches(start_step)
    with _SigtermFlag() as sigterm, metric_writers.ensure_flushes(writer):
        try:
            while step < n_steps:
                batch = sharding.to_global(next(batches), mesh)
                state, m = train_step(state, batch)
                train_metrics = m if train_metrics is None else train_metrics.merge(m)
                step += 1
                report(step)
                is_last = step == n_steps
                preempt = _preempted(sigterm, step)
                pause = stop_at is not None and step >= stop_at and not is_last
                if step % config.log_every == 0 or is_last or preempt or pause:
                    values = {k: float(v) for k, v in train_metrics.compute().items()}
                    _check_finite(config, values, state, step, step_log, mngr, last_saved)
                    dt = max(time.time() - t_log, 1e-9)
                    values["steps_per_sec"] = (step - step_log) / dt
                    values["examples_per_sec"] = values["steps_per_sec"] * global_batch
                    writer.write_scalars(step, {f"train/{k}": v for k, v in values.items()})
                    eta = (n_steps - step) / max(values["steps_per_sec"], 1e-9)
                    logging.info("step %d/%d: loss %.4f, accuracy %.4f, %.2f steps/s, %.0f examples/s, "
                                 "ETA %s", step, n_steps, values["loss"], values["accuracy"],
                                 values["steps_per_sec"], values["examples_per_sec"], _fmt_time(eta))
                    train_metrics, t_log, step_log = None, time.time(), step
                if step % config.eval_every == 0 or is_last:
                    with report.timed("eval"):
                        eval_metrics = evaluate(eval_step, state, eval_data, mesh)
                    writer.write_scalars(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
                    logging.info("eval at step %d: loss %.4f, top-1 %.4f, top-5 %.4f over %d examples",
                                 step, eval_metrics["loss"], eval_metrics["top1"], eval_metrics["top5"],
                                 eval_metrics["num_examples"])
                if step % config.checkpoint_every == 0 or is_last or preempt or pause:
                    if train_metrics is not None:  # never save a state that has not been checked
                        values = {k: float(v) for k, v in train_metrics.compute().items()}
                        _check_finite(config, values, state, step, step_log, mngr, last_saved)
                    with report.timed("checkpoint"):
                        checkpoints.save(mngr, step, state, force=preempt or pause)
                    last_saved = step
                if pause:
                    logging.info("Stopping at step %d as asked (stop_at); re-run to continue.", step)
                    break
                if preempt:
                    mngr.wait_until_finished()
                    raise PreemptedError(f"preempted: checkpoint written at step {step} in "
                                         f"{mngr.directory}; re-run the same command to continue")
        finally:
            mngr.wait_until_finished()
            mngr.close()
    return {"step": step, "eval": eval_metrics, "state": state}


def _check_finite(config, values, state, step, since, mngr, last_saved) -> None:
    streak = int(state.nonfinite_streak)
    limit = config.skip_nonfinite_steps
    bad = [k for k in ("loss", "grad_norm") if not math.isfinite(values[k])]
    if limit == 0 and (bad or values.get("skipped_nonfinite", 0) > 0):
        raise NonFiniteError(
            f"non-finite {' and '.join(bad) or 'loss/grad_norm'} between steps {since + 1} and {step}; "
            f"last good checkpoint: {_describe(last_saved, mngr)}. Lower the learning rate, enable "
            f"grad clipping, or set config.skip_nonfinite_steps.")
    if limit and streak >= limit:
        raise NonFiniteError(
            f"{streak} non-finite steps in a row up to step {step} (config.skip_nonfinite_steps="
            f"{limit}); last good checkpoint: {_describe(last_saved, mngr)}")


def _describe(step, mngr) -> str:
    return "none" if step is None else f"step {step} in {mngr.directory}"


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _init_from_pretrained(config, model_cfg, num_classes, state, tx, state_sharding) -> TrainState:
    from normvit_jax import pretrained
    params = jax.tree.map(np.asarray, state.params)
    params, _ = pretrained.init_from_npz(params, config.init_from, model_cfg, num_classes,
                                         keep_pre_logits=config.get("init_keep_pre_logits"),
                                         image_size=config.data.image_size, log=logging.info)
    new = state.replace(params=params, opt_state=tx.init(params))
    return jax.device_put(new, state_sharding)

"""The one generic training loop: every model size and every normalizer goes through here.

What happens when things go wrong (docs/faults.md has the user-facing promises):
- SIGTERM or Ctrl-C: the step finishes, a checkpoint is written, PreemptedError (exit 42); hosts agree on
  the step (normvit_jax/preemption.py).
- A crash at any moment: the re-run restores the newest complete checkpoint; the train-metrics
  window since the last log step is saved with it, so the resumed run writes the same summaries.
- NaN/Inf: checked at every log step and before every save; never saved; NonFiniteError names
  the first bad step, the metric and the last good checkpoint.
- A checkpoint write that fails (disk full, permissions): WorkdirError naming the step and the
  newest complete checkpoint, which is kept.
"""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from clu import metric_writers, periodic_actions

from normvit_jax import checkpoints, data, preemption, sharding, summaries
from normvit_jax import workdir as workdir_lib
from normvit_jax.train import ema, guards
from normvit_jax.train import optimizer as optim
from normvit_jax.train import progress, setup
from normvit_jax.train.state import TrainState

EXIT_PREEMPTED = 42  # main.py's exit code after a SIGTERM-triggered checkpoint


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the message names the step and last checkpoint."""


class PreemptedError(RuntimeError):
    """A SIGTERM arrived; a checkpoint was written at the step named in the message."""


def total_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
    if config.total_steps:
        return int(config.total_steps)
    return max(1, int(math.ceil(config.num_epochs * steps_per_epoch)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_at: int | None = None, fresh: bool = False) -> dict[str, Any]:
    """Trains and evaluates; re-running with the same workdir continues from the newest checkpoint.

    ``stop_at``: end this process after that step with a checkpoint (the schedule still runs to
    the configured total), for time-sliced jobs; a re-run continues. ``fresh``: start at step 0
    even if the workdir holds a run (moved to ``workdir/replaced/``). Returns the final step, the
    last eval metrics and the state.
    """
    mesh = sharding.make_mesh(config)
    spec = setup.resolve_config(config, mesh.devices.size)
    workdir = workdir_lib.absolute(workdir)
    with preemption.SigtermFlag() as sigterm, workdir_lib.prepare(
            config, workdir, fresh=fresh, process_index=jax.process_index()):
        sharding.sync_hosts("normvit_workdir_ready")  # process 0 has moved/written what it must
        return _run(config, workdir, stop_at, spec, mesh, sigterm)


def _run(config, workdir, stop_at, run_spec, mesh, sigterm) -> dict[str, Any]:
    spec, ds = run_spec.model, run_spec.data
    train_data = data.make_pipeline(config, "train", ds)
    eval_data = data.make_pipeline(config, "eval", ds)
    num_classes = ds.num_classes
    n_steps = total_steps(config, train_data.steps_per_epoch)
    model = setup.create_model(config, num_classes, spec)
    tx, lr_schedule = optim.create(config, n_steps)
    state, state_sharding = setup.create_train_state(model, tx, train_data.image_shape, mesh,
                                                     jax.random.key(config.seed),
                                                     sharding.fsdp_min_size(config))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    logging.info("Model: %s, %s parameters; %d devices (mesh %s); %d steps (%d per epoch).",
                 progress.describe_model(model.spec), f"{n_params:,}", mesh.devices.size,
                 " x ".join(f"{k}={v}" for k, v in mesh.shape.items()), n_steps,
                 train_data.steps_per_epoch)

    mngr = checkpoints.make_manager(workdir, keep=config.keep_checkpoints)
    saver = guards.CheckpointSaver(mngr, workdir)
    try:
        restored = checkpoints.restore_latest(mngr, state)
    except BaseException:
        mngr.close()
        raise
    had_config = checkpoints.config_path(workdir).exists()
    if jax.process_index() == 0:  # the checkpoint fits (or there is none): the config is the run's
        workdir_lib.write_config(config, workdir)
        if ds.class_names:  # label order -> names, for evaluation, predict and people
            workdir_lib.write_json_atomic(workdir, "classes.json", list(ds.class_names))
    window, skipped_total = guards.MetricsWindow(0), 0
    if restored is not None:
        state, start_step = restored.state, restored.step
        window, skipped_total = guards.MetricsWindow.from_meta(restored.meta, start_step)
        pos = start_step * config.batch_size
        logging.info("Resumed from the checkpoint at step %d in %s; the data continues at step %d "
                     "(epoch %d, example %d of %d).", start_step, mngr.directory, start_step + 1,
                     pos // train_data.num_examples + 1, pos % train_data.num_examples,
                     train_data.num_examples)
        saver.last_good = start_step
    else:
        start_step = 0
        if had_config and jax.process_index() == 0:
            logging.warning("No checkpoint in %s: starting at step 0 (an earlier attempt of this "
                            "run ended before its first checkpoint).", mngr.directory)
        if config.init_from:
            state = _init_from_pretrained(config, spec, num_classes, state, tx, state_sharding)

    if sigterm.received and not preemption.multi_process():  # SIGTERM while starting up
        mngr.close()
        raise PreemptedError(f"interrupted before the first step; nothing new to save (newest "
                             f"checkpoint: {saver.describe()}); rerun the same command to resume")
    writer, analysis_writer = _writers(workdir)
    # Marks where this segment of the run starts: readers drop older points after it (summaries.py).
    writer.write_scalars(start_step, {summaries.SEGMENT_TAG: start_step})
    if start_step == 0:
        writer.write_hparams({k: v for k, v in workdir_lib.flat_values(config).items()
                              if isinstance(v, (int, float, str, bool))})

    train_step = setup.jit_train_step(
        setup.make_train_step(config, model, tx, lr_schedule, ds), state_sharding, mesh)
    eval_step = setup.jit_eval_step(model, state_sharding, mesh, ds.affine)

    report = periodic_actions.ReportProgress(num_train_steps=n_steps, writer=writer)
    eta = progress.Eta(n_steps)  # train time only: no compile, eval or checkpoint time
    eval_metrics: dict[str, Any] = {}
    t_log, step_log = time.time(), start_step
    step = start_step
    n_fixed = max(config.eval_analysis_images, config.eval_attention_images)
    fixed_images = analyzer = None
    if n_fixed:  # imported only here: it pulls in matplotlib
        from normvit_jax.analysis import eval_hook
        fixed_images = eval_hook.fixed_images(config, ds, n_fixed)
        analyzer = eval_hook.EvalAnalyzer(model, config, ds)

    def run_eval(step: int) -> dict[str, Any]:
        """Eval over the whole split, then the analysis of a fixed batch (token statistics, norm
        gates, attention distance, attention maps), all written to TensorBoard."""
        with report.timed("eval"):
            metrics = setup.evaluate(eval_step, state, eval_data, mesh)
        writer.write_scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
        if fixed_images is not None:
            with report.timed("eval_analysis"):
                scalars, pictures = analyzer(
                    {"params": state.params, "batch_stats": state.batch_stats}, fixed_images,
                    sharding=sharding.replicated(mesh))
            if analysis_writer is not None:  # process 0; kept out of the log: ~100 scalars
                analysis_writer.write_scalars(step, scalars)
                if pictures:
                    analysis_writer.write_images(step, pictures)
        logging.info("eval at step %d: loss %.4f, top-1 %.4f, top-5 %.4f over %d examples",
                     step, metrics["loss"], metrics["top1"], metrics["top5"],
                     metrics["num_examples"])
        return metrics

    if step >= n_steps:
        logging.info("The run in %s is already complete (step %d of %d).", workdir, step, n_steps)
    batches = train_data.train_batches(start_step)
    with metric_writers.ensure_flushes(writer):
        try:
            while step < n_steps:
                batch = sharding.to_global(next(batches), mesh)
                state, m = train_step(state, batch)
                step += 1
                window.add(step, m)
                report(step)
                is_last = step == n_steps
                preempt = preemption.reached(sigterm, step)
                pause = stop_at is not None and step >= stop_at and not is_last
                save = step % config.checkpoint_every == 0 or is_last or preempt or pause
                if step % config.log_every == 0 or is_last:
                    values, skipped, problem = guards.check_finite(config, window, state, step, saver)
                    eta.mark(step)  # check_finite waited for the step's results
                    skipped_total += skipped
                    dt = max(time.time() - t_log, 1e-9)
                    values["skipped_nonfinite_total"] = skipped_total
                    values["steps_per_sec"] = eta.interval_steps_per_s() or (step - step_log) / dt
                    values["examples_per_sec"] = values["steps_per_sec"] * config.batch_size
                    writer.write_scalars(step, {f"train/{k}": v for k, v in values.items()})
                    logging.info("step %d/%d: loss %.4f, accuracy %.4f, %.2f steps/s, %.0f examples/s, "
                                 "ETA %s", step, n_steps, values["loss"], values["accuracy"],
                                 values["steps_per_sec"], values["examples_per_sec"], eta.describe(step))
                    if problem:  # after writing: the bad values are in the summaries too
                        raise NonFiniteError(problem)
                    window, t_log, step_log = guards.MetricsWindow(step), time.time(), step
                elif save:  # never save a state that has not been checked
                    problem = guards.check_finite(config, window, state, step, saver)[2]
                    if problem:
                        raise NonFiniteError(problem)
                if step % config.eval_every == 0 or is_last:
                    with eta.paused():
                        eval_metrics = run_eval(step)
                if save:
                    if not guards.all_finite(state):
                        raise NonFiniteError(
                            f"the parameters or optimizer state became non-finite by step {step} "
                            f"although loss and grad_norm are finite; not saved; last good "
                            f"checkpoint: {saver.describe()}. Lower the learning rate or enable "
                            "grad clipping (config.optimizer.grad_clip).")
                    writer.flush()  # summaries up to this step are on disk before its checkpoint
                    meta = guards.checkpoint_meta(window, skipped_total)
                    with report.timed("checkpoint"), eta.paused():
                        saver.save(step, state, meta)
                if pause:
                    logging.info("Stopping at step %d as asked (stop_at); re-run to continue.", step)
                    break
                if preempt:
                    saver.wait()
                    raise PreemptedError(f"interrupted at step {step}; saved in {mngr.directory}; "
                                         "rerun the same command to resume")
        except BaseException:
            batches.close()
            saver.close(quiet=True)  # the error in flight says more than a failed last write
            raise
    batches.close()
    saver.close()
    return {"step": step, "eval": eval_metrics, "state": state}


def _writers(workdir: str) -> tuple[Any, Any]:
    """(writer, analysis_writer): TensorBoard summaries on process 0 (both the same writer; no
    metrics writer elsewhere). Not logged: the progress line already shows the train metrics, and
    CLU's LoggingWriter repeated them, and the hyperparameters, as long lines."""
    if jax.process_index() > 0:
        return metric_writers.MultiWriter([]), None
    tensorboard = metric_writers.AsyncWriter(metric_writers.SummaryWriter(workdir))
    return tensorboard, tensorboard


def _init_from_pretrained(config, spec, num_classes, state, tx, state_sharding) -> TrainState:
    from jax.experimental import multihost_utils

    from normvit_jax import pretrained
    # whole arrays on every process, also for an FSDP state split across hosts
    params = multihost_utils.process_allgather(state.params, tiled=True)
    params, _ = pretrained.init_from_npz(params, config.init_from, spec, num_classes,
                                         keep_pre_logits=config.get("init_keep_pre_logits"),
                                         image_size=config.data.image_size, log=logging.info)
    new = state.replace(params=params, opt_state=ema.init_stats(tx.init(params), state.batch_stats))
    return jax.device_put(new, state_sharding)

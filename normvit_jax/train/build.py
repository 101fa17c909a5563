"""Building a training run: everything the loop needs before its first step, as one ``Run``.

``build_run`` opens the pipelines, builds the model, optimizer and state (initialised into its
sharding, then restored from the newest checkpoint or loaded from ``config.init_from``), writes
the run's config.json, classes.json and data.json (``run_data``), opens the summary writers and
jits the train step and the evaluator. It takes no guard itself: ``loop.train_and_evaluate``
holds the workdir lock and the SIGTERM flag.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from normvit_jax import checkpoints, data, run_code, run_config, run_data, sharding, summaries
from normvit_jax.norms import progressive
from normvit_jax.train import ema, guards
from normvit_jax.train import optimizer as optim
from normvit_jax.train import phases, progress, setup, tensorboard
from normvit_jax.train.evaluator import Evaluator
from normvit_jax.train.state import TrainState


@dataclasses.dataclass
class Run:
    """A training run ready for its first step (the loop advances ``state``)."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: Mesh
    train_data: data.Pipeline
    eval_data: data.Pipeline
    model: Any
    n_steps: int
    state: TrainState
    train_step: phases.PhasedTrainStep  # .at(step): the step compiled for step's phase
    saver: guards.CheckpointSaver
    writer: Any                  # TensorBoard on process 0, a no-op writer elsewhere
    evaluator: Evaluator
    start_step: int
    window: guards.MetricsWindow  # train metrics since the last log step (restored on resume)
    skipped_total: int           # non-finite steps skipped so far (config.skip_nonfinite_steps)
    step_reached: int | None = None  # the last step trained (trainer.train): the run's end state


@dataclasses.dataclass
class _Start:
    """Where the run starts: its state and the loop's counters (restored or fresh)."""

    state: TrainState
    step: int
    window: guards.MetricsWindow
    skipped_total: int


def total_steps(config: ml_collections.ConfigDict, steps_per_epoch: int) -> int:
    if config.total_steps:
        return int(config.total_steps)
    return max(1, int(math.ceil(config.num_epochs * steps_per_epoch)))


def build_run(config: ml_collections.ConfigDict, workdir: str, run_spec: setup.RunSpec,
              mesh: Mesh, rerun: str = "rerun the same command",
              pipelines: tuple[data.Pipeline, data.Pipeline] | None = None) -> Run:
    """The run in ``workdir`` (restored if it holds a checkpoint). A signal while it is built
    stops the process at once (preemption.py: nothing new to save). ``rerun``: how to continue
    after a failed checkpoint write (``workdir.rerun_advice``). ``pipelines``: the (train, eval)
    pipelines when the caller opened them (the loop does, among the checks every process agrees
    on); else opened here."""
    ds = run_spec.data
    train_data, eval_data = pipelines or (data.make_pipeline(config, "train", ds),
                                          data.make_pipeline(config, "eval", ds))
    n_steps = total_steps(config, train_data.steps_per_epoch)
    model = setup.create_model(config, ds.num_classes, run_spec.model)
    tx, lr_schedule = optim.create(config, n_steps)
    note = optim.warmup_note(config, n_steps)
    if note:  # the schedule differs from the config's: said once, at start
        logging.warning(note)
    note = progressive.handover_note(
        [run_spec.model.norm, *dict(run_spec.model.norm_overrides).values()], n_steps)
    if note:  # a progressive norm evaluated as N2 that training never fully handed over to
        logging.warning(note)
    state, state_sharding = setup.create_train_state(model, tx, train_data.image_shape, mesh,
                                                     jax.random.key(config.seed),
                                                     sharding.fsdp_min_size(config))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    logging.info("Model: %s, %s parameters; %d devices (mesh %s); %s.",
                 progress.describe_model(model.spec), f"{n_params:,}", mesh.devices.size,
                 " x ".join(f"{k}={v}" for k, v in mesh.shape.items()),
                 progress.describe_steps(n_steps, train_data.num_examples, config.batch_size))
    split = sharding.describe_fsdp(state.params, int(mesh.shape.get(sharding.FSDP_AXIS, 1)),
                                   sharding.fsdp_min_size(config))
    if split:  # fsdp > 1: what it splits (a small model may split nothing)
        logging.info("%s.", split)

    saver = guards.CheckpointSaver(checkpoints.make_manager(workdir, keep=config.keep_checkpoints),
                                   workdir, rerun=rerun)
    step_fn = setup.make_train_step(config, model, tx, lr_schedule, ds)
    metrics_like = functools.partial(setup.train_metrics_shapes, step_fn,
                                     batch_size=config.batch_size,
                                     image_shape=train_data.image_shape)
    start = _start(config, workdir, run_spec, state, tx, state_sharding, saver, train_data,
                   metrics_like, n_steps)
    if start.step >= n_steps:  # complete: no event file, no segment (nothing is trained)
        writer, analysis_writer = tensorboard.NullWriter(), None
    else:
        writer, analysis_writer = _writers(workdir)
    # Marks where this segment of the run starts: readers drop older points after it (summaries.py).
    writer.write_scalars(start.step, {summaries.SEGMENT_TAG: start.step})
    if start.step == 0:
        writer.write_hparams({k: v for k, v in run_config.flat_values(config).items()
                              if isinstance(v, (int, float, str, bool))})

    def jitted_step(m: Any) -> Any:  # the run's model, or the same model told a phase
        fn = step_fn if m is model else setup.make_train_step(config, m, tx, lr_schedule, ds)
        return setup.jit_train_step(fn, state_sharding, mesh)

    # one compiled step per phase of the step-scheduled norms (train/phases.py)
    train_step = phases.PhasedTrainStep(jitted_step, model)
    evaluator = Evaluator(config, ds, model, state_sharding, mesh, eval_data, writer,
                          analysis_writer, workdir=workdir)
    return Run(config, workdir, mesh, train_data, eval_data, model, n_steps, start.state,
               train_step, saver, writer, evaluator, start.step, start.window,
               start.skipped_total)


def _start(config, workdir, run_spec, state, tx, state_sharding, saver, train_data,
           metrics_like, n_steps) -> _Start:
    """Restores the newest checkpoint (then config.json and data.json are the run's), else
    starts at step 0 (from ``config.init_from`` if set). ``metrics_like(state)``: the train step's
    metrics tree, to rebuild the saved train-metrics window with the run's own metrics class."""
    mngr = saver.mngr
    try:
        restored = checkpoints.restore_latest(mngr, state)
    except BaseException:
        mngr.close()
        raise
    gone = checkpoints.checkpoints_gone(workdir) if restored is None else None
    if gone:  # before anything is written: a restart at 0 would mix two histories in one workdir
        mngr.close()
        raise checkpoints.RunNotFoundError(
            f"{gone}; put them back to continue, or rerun with --fresh to start over at step 0 "
            f"(the old run is moved to {workdir}/replaced/)")
    if restored is None and config.init_from:
        # before anything is written: a file that does not load leaves no run behind (cli.run
        # removes a workdir it created); a resumed run never reads it again
        state = init_from_pretrained(config, run_spec.model, run_spec.data.num_classes, state, tx,
                                     state_sharding)
    had_config = checkpoints.config_path(workdir).exists()
    complete = restored is not None and restored.step >= n_steps
    if restored is not None and restored.step > n_steps:
        mngr.close()  # before anything is written: config.json keeps the run's length
        raise run_config.ConfigChangedError(
            f"the run in {workdir} is at step {restored.step}, past this config's "
            f"{n_steps} steps (total_steps={config.total_steps}, num_epochs={config.num_epochs}):"
            f" a run cannot be shortened below its step; nothing was changed; use another "
            f"--workdir for a shorter run (init_from a checkpoint, docs/faults.md)")
    if restored is not None and not complete and had_config and jax.process_index() == 0:
        note = schedule_change_note(run_config.read_saved(checkpoints.config_path(workdir)),
                                    config, restored.step, n_steps, train_data.num_examples)
        if note:
            logging.warning("%s", note)
    # a complete run is left as it is: a re-run trains nothing (trainer.train says so); one whose
    # config.json is gone gets it back (check_config let it through with allow_config_change)
    if jax.process_index() == 0 and (not complete or not had_config):  # the checkpoint fits: the config is the run's
        run_config.write_config(config, workdir)
        if run_spec.data.class_names:  # label order -> names, for evaluation, predict and people
            run_config.write_json_atomic(workdir, "classes.json", list(run_spec.data.class_names))
        # the input statistics the model learns with: predict/export need no dataset, and a
        # dataset prepared again later cannot change them (run_data.py)
        run_data.write(workdir, run_data.of_spec(run_spec.data))
    if jax.process_index() == 0 and not complete:  # which code computes the steps from here
        run_code.record_start(workdir, 0 if restored is None else restored.step)
    if restored is not None:
        step = restored.step
        window, skipped_total = guards.MetricsWindow.from_meta(
            restored.meta, step, lambda: metrics_like(restored.state))
        pos, n = step * config.batch_size, train_data.num_examples
        if step < n_steps:  # a complete run reads no more data (trainer.train says it is complete)
            logging.info("Resumed from the checkpoint at step %d in %s; the data continues at "
                         "step %d (epoch %d, example %d of %d).", step, mngr.directory, step + 1,
                         pos // n + 1, pos % n, n)
        note = guards.mesh_change_note(restored.meta, jax.tree.leaves(state_sharding)[0].mesh)
        if note and step < n_steps:  # another mesh or device count: the checkpoint's meta has its own
            logging.info("%s", note)
        if config.init_from:  # a changed init_from (allow_config_change) would otherwise go unread silently
            logging.info("config.init_from=%s is not read again: it initialises step 0 only "
                         "(--fresh starts over from it).", config.init_from)
        saver.last_good = step
        return _Start(restored.state, step, window, skipped_total)
    if had_config and jax.process_index() == 0:
        logging.warning("No checkpoint in %s: starting at step 0 (an earlier attempt of this "
                        "run ended before its first checkpoint).", mngr.directory)
    return _Start(state, 0, guards.MetricsWindow(0), 0)


def schedule_change_note(saved: dict, config: ml_collections.ConfigDict, step: int,
                         n_steps: int, num_examples: int) -> str | None:
    """One line when a resume changes the learning-rate schedule's inputs
    (``run_config.SCHEDULE_KEYS``, ``schedule.*``): the schedule is computed again from the new
    config, so the rate at ``step`` (that of the next update) moves; None when they are the
    same. ``saved``: the run's config.json; ``num_examples``: the train split's (the steps of an
    epoch at the saved batch size)."""
    keys = [k for k, _, _ in run_config.changed_keys(saved, run_config.saved_values(config))
            if run_config.is_schedule_key(k)]
    if not keys:
        return None
    from configs import run_config as run_config_file  # pylint: disable=import-outside-toplevel
    old = run_config_file.from_saved(saved)
    old_steps = total_steps(old, max(1, num_examples // int(old.batch_size)))
    before = float(optim.schedule(old, old_steps)(step))
    after = float(optim.schedule(config, n_steps)(step))
    return (f"The learning rate at step {step} goes from {before:.3g} (the run's schedule over "
            f"{old_steps} steps) to {after:.3g} (the new one over {n_steps} steps): the schedule "
            f"is computed again from the changed {', '.join(keys)} (docs/faults.md, "
            "\"Extending a run\").")


def _writers(workdir: str) -> tuple[Any, Any]:
    """(writer, analysis_writer): TensorBoard summaries on process 0 (train/tensorboard.py, without
    TensorFlow; both the same writer; no metrics writer elsewhere). Not logged: the progress line
    already shows the train metrics, and a logging writer repeated them, and the hyperparameters,
    as long lines."""
    if jax.process_index() > 0:
        return tensorboard.NullWriter(), None
    writer = tensorboard.SummaryWriter(workdir)
    return writer, writer


def _input_normalization(config: ml_collections.ConfigDict) -> str:
    """config.data.normalize, as the loader's note compares it: 'zscore' on a dataset whose
    statistics are ImageNet's (imagenet2012's table) is 'imagenet'."""
    normalize = str(config.data.normalize)
    if normalize == "zscore":
        from normvit_jax.data import stats  # pylint: disable=import-outside-toplevel
        try:
            same = np.allclose(stats.affine(config.data.name, "zscore"),
                               stats.affine_of({}, "imagenet"))
        except (KeyError, ValueError, OSError):  # a prepared dataset: statistics of its own
            same = False
        normalize = "imagenet" if same else normalize
    return normalize


def init_from_pretrained(config: ml_collections.ConfigDict, spec: Any, num_classes: int,
                         state: TrainState, tx: Any, state_sharding: Any) -> TrainState:
    """``state`` with the parameters of ``config.init_from`` (an .npz or a timm state dict; the
    head re-initialised unless its shape fits; a timm file's BatchNorm running statistics into
    ``batch_stats``) and a fresh optimizer state for them, in ``state_sharding``."""
    from jax.experimental import multihost_utils

    from normvit_jax import pretrained
    from normvit_jax.models import google_layout
    # whole arrays on every process, also for an FSDP state split across hosts
    params = multihost_utils.process_allgather(state.params, tiled=True)
    stats = multihost_utils.process_allgather(state.batch_stats, tiled=True)
    params, stats, _ = pretrained.init_from_checkpoint(
        params, stats, config.init_from, spec, num_classes,
        keep_pre_logits=config.get("init_keep_pre_logits"), image_size=config.data.image_size,
        source_grid=(google_layout.parse_grid(config.init_source_grid)
                     if config.get("init_source_grid") else None),
        normalize=_input_normalization(config), reset_head=bool(config.get("init_reset_head")),
        log=logging.info)
    opt_state = ema.init_stats(tx.init(params), stats)
    new = state.replace(params=params, batch_stats=stats, opt_state=opt_state)
    return jax.device_put(new, state_sharding)

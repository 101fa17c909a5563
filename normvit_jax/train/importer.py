"""``main.py --mode=import``: a run of step 0 holding exactly ``config.init_from`` (a model trained
elsewhere: timm, DeiT, the methods' original code), without a training step, so that every tool
that takes a workdir (eval, predict, reparam, export, recalibrate, analysis) takes it as it is.

It is ``loop.train_and_evaluate`` up to its first step: the same checks, lock and pipelines, the
same ``build.build_run`` (which loads ``init_from``, params and batch_stats, with a fresh optimizer
state, and writes config.json, classes.json, data.json and code.jsonl), then the checkpoint of
step 0 and the eval the loop would run, instead of ``trainer.train``. Re-running training with the
same config and workdir resumes from that checkpoint: a fine-tune of the imported weights.

A built-in dataset that is not on this machine (ImageNet for a DeiT) still resolves (classes,
statistics and split sizes are tables), so the run is written without opening it and without its
eval (one warning line); ``--mode=eval`` evaluates it where the dataset is. One process only: with
several, each would decide alone whether to evaluate (a collective), so the error stops them all.
"""
from __future__ import annotations

import contextlib
from typing import Any

import jax
import ml_collections
from absl import logging

from normvit_jax import distributed, preemption, run_config, run_data, sharding
from normvit_jax import workdir as workdir_lib
from normvit_jax.train import setup


def check_importable(config: ml_collections.ConfigDict, workdir: str, fresh: bool) -> None:
    """Raises ValueError (exit 2): no ``init_from``, or a workdir that already holds a run (an
    import would otherwise resume it and load nothing) unless ``fresh``."""
    if not config.get("init_from"):
        raise ValueError("--mode=import needs --config.init_from=FILE (a timm/PyTorch state dict "
                         ".safetensors/.pth or a ViT .npz; docs/pretrained.md)")
    if fresh or workdir_lib.is_remote(workdir):
        return
    from normvit_jax import checkpoints  # pylint: disable=import-outside-toplevel
    if run_config.has_checkpoint(workdir) or checkpoints.config_path(workdir).exists():
        raise ValueError(f"{workdir} already holds a run: --mode=import writes a new one; pass "
                         "--fresh to move the old run aside first, or choose another --workdir")


def import_run(config: ml_collections.ConfigDict, workdir: str, fresh: bool = False,
               evaluate: bool = True, exit_at_once: bool = False) -> dict[str, Any]:
    """Writes the run of step 0 with ``config.init_from``'s weights and evaluates it once
    (``evaluate``). Returns {'step': 0, 'eval': metrics or {}, 'state': the state}. Raises what
    ``train_and_evaluate`` raises before its first step; ``exit_at_once``: as there."""
    rerun = workdir_lib.rerun_advice(fresh)
    with preemption.SigtermFlag(rerun, exit_at_once=exit_at_once):
        workdir = workdir_lib.absolute(workdir)
        check_importable(config, workdir, fresh)
        from normvit_jax import data  # pylint: disable=import-outside-toplevel  (may import TF)
        lock, failure, unopened = None, None, None
        try:
            mesh = sharding.make_mesh(config)
            run_spec = setup.resolve_config(config, mesh.devices.size)
            lock = workdir_lib.prepare(config, workdir, fresh=fresh,
                                       process_index=jax.process_index(),
                                       data_record=run_data.of_spec(run_spec.data))
            try:
                pipelines = (data.make_pipeline(config, "train", run_spec.data),
                             data.make_pipeline(config, "eval", run_spec.data))
            except data.DatasetNotFoundError as e:
                if jax.process_count() > 1:
                    raise
                pipelines, unopened = None, e
        except Exception as e:  # noqa: BLE001  (re-raised by agree, here or on every process)
            failure = e
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        try:
            distributed.agree("the import's checks", failure)
            distributed.check_shared_workdir(workdir)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        with lock:
            if pipelines is None:
                return _write_without_data(config, workdir, run_spec, mesh, rerun, unopened)
            from normvit_jax.train import build, guards  # pylint: disable=import-outside-toplevel
            run = build.build_run(config, workdir, run_spec, mesh, rerun=rerun, pipelines=pipelines)
            try:
                with contextlib.closing(run.writer):
                    run.saver.save(0, run.state, guards.checkpoint_meta(run.window, 0, run.mesh))
                    run.saver.wait()
                    logging.info("Imported %s into %s as the checkpoint of step 0 (no training "
                                 "step).", config.init_from, workdir)
                    warn_zero_head(run.state.params)
                    metrics = run.evaluator(run.state, 0) if evaluate else {}
            finally:
                run.saver.close()
            return {"step": 0, "eval": metrics, "state": run.state}


def _write_without_data(config: ml_collections.ConfigDict, workdir: str, run_spec: setup.RunSpec,
                        mesh: Any, rerun: str, unopened: Exception) -> dict[str, Any]:
    """The run of step 0 as ``build.build_run`` starts it, from the DataSpec alone (the image
    shape; the split size of its table, for the optimizer's schedule): no pipeline, no eval."""
    # pylint: disable=import-outside-toplevel,protected-access
    from normvit_jax import checkpoints
    from normvit_jax.train import build, guards
    from normvit_jax.train import optimizer as optim
    logging.warning("The dataset cannot be opened here (%s); the imported run is written without "
                    "its eval: --mode=eval evaluates it where the dataset is.",
                    str(unopened).split("; ")[0])
    ds = run_spec.data
    model = setup.create_model(config, ds.num_classes, run_spec.model)
    per_epoch = max(1, int(ds.num_train_examples or config.batch_size) // int(config.batch_size))
    tx, _ = optim.create(config, build.total_steps(config, per_epoch))
    state, state_sharding = setup.create_train_state(model, tx, ds.image_shape, mesh,
                                                     jax.random.key(config.seed),
                                                     sharding.fsdp_min_size(config))
    saver = guards.CheckpointSaver(checkpoints.make_manager(workdir, keep=config.keep_checkpoints),
                                   workdir, rerun=rerun)
    try:  # build's own start: init_from loaded, config/classes/data/code records written
        start = build._start(config, workdir, run_spec, state, tx, state_sharding, saver, None, None,
                             n_steps=0)  # no data stream: never "continues at step"
        saver.save(0, start.state, guards.checkpoint_meta(start.window, 0, mesh))
    finally:
        saver.close()
    logging.info("Imported %s into %s as the checkpoint of step 0 (no training step).",
                 config.init_from, workdir)
    warn_zero_head(start.state.params)
    return {"step": 0, "eval": {}, "state": start.state}


def warn_zero_head(params: Any) -> None:
    """One warning line when the imported head is zeros (the file's head had another class count,
    or config.init_reset_head): the import's eval and its predictions are those of no classifier."""
    from normvit_jax import checkpoints  # pylint: disable=import-outside-toplevel
    n = checkpoints.zero_head_classes(jax.device_get(params))
    if n:
        logging.warning("The imported head is zeros (re-initialised for the dataset's %d classes; "
                        "the report's head rows say why): every image gets probability 1/%d until "
                        "the run is trained, so predict and export of this workdir mean nothing "
                        "before a fine-tune (docs/pretrained.md).", n, n)

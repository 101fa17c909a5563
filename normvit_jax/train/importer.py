"""``main.py --mode=import``: a run of step 0 holding exactly ``config.init_from`` (a model trained
elsewhere: timm, DeiT, the methods' original code), without a training step, so that every tool
that takes a workdir (eval, predict, reparam, export, recalibrate, analysis) takes it as it is.

It is ``loop.train_and_evaluate`` up to its first step: the same checks, lock and pipelines, the
same ``build.build_run`` (which loads ``init_from``, params and batch_stats, with a fresh optimizer
state, and writes config.json, classes.json, data.json and code.jsonl), then the checkpoint of
step 0 and the eval the loop would run, instead of ``trainer.train``. Re-running training with the
same config and workdir resumes from that checkpoint: a fine-tune of the imported weights.
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
               evaluate: bool = True) -> dict[str, Any]:
    """Writes the run of step 0 with ``config.init_from``'s weights and evaluates it once
    (``evaluate``). Returns {'step': 0, 'eval': metrics or {}, 'state': the state}. Raises what
    ``train_and_evaluate`` raises before its first step."""
    rerun = workdir_lib.rerun_advice(fresh)
    with preemption.SigtermFlag(rerun):
        workdir = workdir_lib.absolute(workdir)
        check_importable(config, workdir, fresh)
        from normvit_jax import data  # pylint: disable=import-outside-toplevel  (may import TF)
        lock, failure = None, None
        try:
            mesh = sharding.make_mesh(config)
            run_spec = setup.resolve_config(config, mesh.devices.size)
            lock = workdir_lib.prepare(config, workdir, fresh=fresh,
                                       process_index=jax.process_index(),
                                       data_record=run_data.of_spec(run_spec.data))
            pipelines = (data.make_pipeline(config, "train", run_spec.data),
                         data.make_pipeline(config, "eval", run_spec.data))
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
            from normvit_jax.train import build, guards  # pylint: disable=import-outside-toplevel
            run = build.build_run(config, workdir, run_spec, mesh, rerun=rerun, pipelines=pipelines)
            try:
                with contextlib.closing(run.writer):
                    run.saver.save(0, run.state, guards.checkpoint_meta(run.window, 0))
                    run.saver.wait()
                    logging.info("Imported %s into %s as the checkpoint of step 0 (no training "
                                 "step).", config.init_from, workdir)
                    metrics = run.evaluator(run.state, 0) if evaluate else {}
            finally:
                run.saver.close()
            return {"step": 0, "eval": metrics, "state": run.state}

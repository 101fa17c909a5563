"""The training run's evaluation: the eval split's metrics, then the analysis of a fixed batch
(token statistics, norm gates, attention distances and maps; ``analysis/eval_hook.py``), all
written to TensorBoard at the step they were measured at.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.sharding import Mesh

from normvit_jax import data, sharding
from normvit_jax.train import setup
from normvit_jax.train.state import TrainState


def nonfinite_warning(metrics: dict[str, Any], step: int, workdir: str, batch_stats: Any
                      ) -> str | None:
    """One line naming the eval metrics of ``step`` that are NaN/Inf and what to do; None when all
    are finite. The train loss is checked (exit 3), these are not: a diverged running statistic
    (batch norm) gives a finite train loss and a NaN eval, which was written and the run ended
    in exit 0 without a word. Training goes on (the weights may be fine: recalibrate fixes the
    statistics)."""
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if not bad:
        return None
    fix = (f"the running statistics may have diverged: python -m normvit_jax.recalibrate "
           f"--workdir={workdir} --out=DIR re-estimates them; "
           if jax.tree.leaves(batch_stats) else "")
    return (f"eval at step {step}: {', '.join(f'{k} {metrics[k]}' for k in bad)} (not finite); "
            f"{fix}see docs/faults.md, NaN/Inf")


class Evaluator:
    """``evaluator(state, step) -> metrics``; built once per run (the eval step and the analysis
    forward compile at their first call)."""

    def __init__(self, config: ml_collections.ConfigDict, data_spec: data.DataSpec, model: Any,
                 state_sharding: Any, mesh: Mesh, eval_data: data.Pipeline, writer: Any,
                 analysis_writer: Any, workdir: str = "WORKDIR"):
        self.eval_step = setup.jit_eval_step(model, state_sharding, mesh, data_spec.affine)
        self.eval_data, self.mesh = eval_data, mesh
        self.writer, self.analysis_writer = writer, analysis_writer
        self.workdir = workdir  # named in the advice of a non-finite eval
        self.fixed_images = self.analyzer = None
        n_fixed = max(config.eval_analysis_images, config.eval_attention_images)
        if n_fixed:  # imported only here: it pulls in matplotlib
            from normvit_jax.analysis import eval_hook
            self.fixed_images = eval_hook.fixed_images(config, data_spec, n_fixed)
            self.analyzer = eval_hook.EvalAnalyzer(model, config, data_spec)

    def __call__(self, state: TrainState, step: int) -> dict[str, Any]:
        metrics = setup.evaluate(self.eval_step, state, self.eval_data, self.mesh)
        self.writer.write_scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
        if self.analyzer is not None:
            scalars, pictures = self.analyzer(
                {"params": state.params, "batch_stats": state.batch_stats}, self.fixed_images,
                sharding=sharding.replicated(self.mesh))
            if self.analysis_writer is not None:  # process 0; kept out of the log: ~100 scalars
                self.analysis_writer.write_scalars(step, scalars)
                if pictures:
                    self.analysis_writer.write_images(step, pictures)
        logging.info("eval at step %d: loss %.4f, top-1 %.4f, top-5 %.4f over %d examples",
                     step, metrics["loss"], metrics["top1"], metrics["top5"],
                     metrics["num_examples"])
        note = nonfinite_warning(metrics, step, self.workdir, state.batch_stats)
        if note:
            logging.warning(note)
        return metrics

"""The step loop of a built ``Run``: one train step per batch, then the ``StepPolicy``'s actions
(log and check, evaluate, save, pause, preempt) in that order.

What happens when things go wrong (docs/faults.md has the user-facing promises):
- SIGTERM or Ctrl-C: the step finishes, a checkpoint is written, PreemptedError (SIGTERM) or
  TrainingInterrupted (Ctrl-C, a KeyboardInterrupt), exit 42 both; hosts agree on the step
  (normvit_jax/preemption.py).
- A crash at any moment: the re-run restores the newest complete checkpoint; the train-metrics
  window since the last log step is saved with it, so the resumed run writes the same summaries.
- NaN/Inf: checked at every log step and before every save; never saved; NonFiniteError names
  the first bad step, the metric and the last good checkpoint.
- A checkpoint write that fails (disk full, permissions): WorkdirError naming the step and the
  newest complete checkpoint, which is kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from typing import Any

import jax
from absl import logging

from normvit_jax import preemption, sharding
from normvit_jax.train import guards, progress
from normvit_jax.train.build import Run
from normvit_jax.train.policy import (NonFiniteError, PreemptedError, StepPolicy,
                                      TrainingInterrupted)


@dataclasses.dataclass
class _LastLog:
    time: float
    step: int
    compiled: bool = False  # the train step was compiled before ``time`` (or a mark followed)


def train(run: Run, policy: StepPolicy, sigterm: preemption.SigtermFlag) -> dict[str, Any]:
    """Steps ``run`` to ``run.n_steps`` (or ``policy.stop_at``, or a SIGTERM); returns the final
    step, the last eval metrics and the state. The saver is closed on every way out."""
    # the train rate without compile, eval or checkpoint time, plus the evals and writes to come
    eta = progress.Eta(run.n_steps, eval_every=policy.eval_every,
                       checkpoint_every=policy.checkpoint_every)
    last_log = _LastLog(time.time(), run.start_step)
    eval_metrics: dict[str, Any] = {}
    step = run.step_reached = run.start_step
    if step >= run.n_steps:  # nothing to compile or read: the recorded result, in one line
        return _complete(run, step)
    batches = run.train_data.train_batches(step)
    with contextlib.closing(run.writer):  # its records on disk whatever ends the loop
        try:
            first = _announce_run_time(run, step, batches)
            if first is not None:  # the step is compiled: the first interval is training only
                last_log.time, last_log.compiled = time.time(), True
            step_fn = None
            while step < run.n_steps:
                batch = sharding.to_global(next(batches), run.mesh) if first is None else first
                first = None
                phase_fn = run.train_step.at(step)
                # a progressive hand-over's next phase compiles its own step now (phases.py):
                # an ETA pause, as an eval is, not a slow interval of training
                switch = step_fn is not None and phase_fn is not step_fn
                if switch:
                    logging.info("Compiling the train step of the next phase (from step %d: "
                                 "train/phases.py).", step + 1)
                step_fn = phase_fn
                with eta.paused() if switch else contextlib.nullcontext():
                    run.state, m = step_fn(run.state, batch)
                if step == run.start_step:  # compiled and run: a signal now ends in a checkpoint
                    sigterm.started()
                step += 1
                run.step_reached = step
                run.window.add(step, m)
                act = policy.after(step, preemption.reached(sigterm, step))
                if act.log:
                    _log(run, step, eta, last_log)
                elif act.check:  # never save a state that has not been checked
                    problem = guards.check_finite(run.config, run.window, run.state, step,
                                                  run.saver)[2]
                    if problem:
                        raise NonFiniteError(problem)
                if act.evaluate:
                    with eta.paused("eval"):
                        eval_metrics = run.evaluator(run.state, step)
                if act.save:
                    _save(run, step, eta)
                if act.pause:
                    logging.info("Stopping at step %d as asked (stop_at); re-run to continue.", step)
                    break
                if act.preempt:
                    run.saver.wait()
                    logging.info(eta.wall_time_line())
                    # Ctrl-C: a KeyboardInterrupt (a caller's `except Exception` lets it by)
                    error = (TrainingInterrupted if sigterm.signum == signal.SIGINT
                             else PreemptedError)
                    raise error(f"interrupted at step {step}; saved in "
                                f"{run.saver.mngr.directory}; {sigterm.rerun} to resume")
        except BaseException:
            batches.close()
            run.saver.close(quiet=True)  # the error in flight says more than a failed last write
            raise
    batches.close()
    run.saver.close()
    logging.info(eta.wall_time_line())
    return {"step": step, "eval": eval_metrics, "state": run.state}


def _announce_run_time(run: Run, step: int, batches: Any) -> Any:
    """On CPU with ``progress.MEASURE_MIN_STEPS`` steps or more to go: times the train step on a
    copy of the state, logs the expected run time and returns the first batch (global); else None.
    Not on accelerators: there the copy could take memory the run needs (the ETA of the progress
    line is the estimate)."""
    if run.n_steps - step < progress.MEASURE_MIN_STEPS or jax.default_backend() != "cpu":
        # nothing is timed first: say what the silence until the first progress line is
        logging.info("Compiling the train step; the first progress line follows it (%d steps "
                     "to go, every %d logged).", run.n_steps - step, int(run.config.log_every))
        return None
    batch = sharding.to_global(next(batches), run.mesh)
    step_s, first_s = progress.measure_step_s(run.train_step.at(step), run.state, batch)
    logging.info("Compiled the train step in %.1f s.", max(first_s - step_s, 0.0))
    logging.info(progress.expected_time_line(step, run.n_steps, step_s))
    return batch


def _log(run: Run, step: int, eta: progress.Eta, last: _LastLog) -> None:
    """Checks and writes the train metrics since the last log step; raises NonFiniteError (after
    writing: the bad values are in the summaries too)."""
    values, skipped, problem = guards.check_finite(run.config, run.window, run.state, step,
                                                   run.saver)
    eta.mark(step)  # check_finite waited for the step's results
    run.skipped_total += skipped
    dt = max(time.time() - last.time, 1e-9)
    values["skipped_nonfinite_total"] = run.skipped_total
    values["steps_per_sec"] = eta.interval_steps_per_s() or (step - last.step) / dt
    values["examples_per_sec"] = values["steps_per_sec"] * run.config.batch_size
    run.writer.write_scalars(step, {f"train/{k}": v for k, v in values.items()})
    # an unmeasured start (accelerators, short runs) compiles inside the first interval
    note = "" if last.compiled else " (compilation included)"
    logging.info("step %d/%d: loss %.4f, accuracy %.4f, %.2f steps/s, %.0f examples/s%s, ETA %s",
                 step, run.n_steps, values["loss"], values["accuracy"], values["steps_per_sec"],
                 values["examples_per_sec"], note, eta.describe(step))
    if problem:
        raise NonFiniteError(problem)
    run.window = guards.MetricsWindow(step)
    last.time, last.step, last.compiled = time.time(), step, True


def _save(run: Run, step: int, eta: progress.Eta) -> None:
    """Saves the checked state with the metrics window (async; ``saver`` reports failures).
    All of it is a pause of the ETA: the finiteness check compiles at the first save."""
    with eta.paused("save"):
        if not guards.all_finite(run.state):
            raise NonFiniteError(
                f"the parameters or optimizer state became non-finite by step {step} although "
                f"loss and grad_norm are finite; not saved; last good checkpoint: "
                f"{run.saver.describe()}. Lower the learning rate or enable grad clipping "
                "(config.optimizer.grad_clip).")
        run.writer.flush()  # summaries up to this step are on disk before its checkpoint
        meta = guards.checkpoint_meta(run.window, run.skipped_total, run.mesh)
        run.saver.save(step, run.state, meta)


def _complete(run: Run, step: int) -> dict[str, Any]:
    """A re-run of a finished run: says so, with the last eval the run recorded (its summaries),
    and returns it as ``train`` does; the train step is not compiled and no data is read."""
    eval_metrics, eval_step = _recorded_eval(run.workdir)
    seen = (f"its eval at step {eval_step}, as recorded, follows" if eval_metrics else
            "it recorded no eval (--mode=eval evaluates it)")
    logging.info("The run in %s is already complete (step %d of %d): nothing to train (--fresh "
                 "starts it over); %s.", run.workdir, step, run.n_steps, seen)
    run.writer.close()
    run.saver.close()
    return {"step": step, "eval": eval_metrics, "state": run.state}


def _recorded_eval(workdir: str) -> tuple[dict[str, Any], int | None]:
    """({metric: value}, step) of the newest eval in the run's summaries (``eval/*`` scalars at
    the last step of ``eval/top1``); ({}, None) if there is none or they cannot be read."""
    from normvit_jax import summaries  # pylint: disable=import-outside-toplevel
    try:
        scalars = summaries.read_scalars(workdir, include_timing=False)
    except Exception as e:  # noqa: BLE001  (a damaged event file must not fail a finished run)
        logging.warning("Cannot read the summaries of %s (%s: %s).", workdir, type(e).__name__, e)
        return {}, None
    if not scalars.get("eval/top1"):
        return {}, None
    last = scalars["eval/top1"][-1][0]
    metrics = {tag[len("eval/"):]: points[-1][1] for tag, points in scalars.items()
               if tag.startswith("eval/") and points[-1][0] == last}
    # as the evaluator returned them (setup.evaluate): the counts as ints (a summary holds
    # floats), its order of keys (the summaries' is alphabetical)
    return {k: int(metrics[k]) if k.endswith("num_examples") else metrics[k]
            for k in sorted(metrics, key=_eval_order)}, last


_EVAL_FIRST = ("loss", "top1", "top5", "num_examples")  # setup.evaluate's order


def _eval_order(key: str) -> tuple[bool, int, str]:
    name = key[len("ema_"):] if key.startswith("ema_") else key
    rank = _EVAL_FIRST.index(name) if name in _EVAL_FIRST else len(_EVAL_FIRST)
    return key.startswith("ema_"), rank, name

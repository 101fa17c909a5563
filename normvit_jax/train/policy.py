"""What the loop does after a step, decided in one place: log, check, evaluate, save, pause or
stop for a preemption (the loop carries the actions out in that order), and the errors that end a
run early.

Rules: a log step (every ``log_every``, and the last) writes the train summaries and checks the
metrics for NaN/Inf; a step that saves but does not log is checked too (never save a state that
has not been checked). Saves happen every ``checkpoint_every``, at the last step, at ``stop_at``
and after a SIGTERM. Evaluation every ``eval_every`` and at the last step.
"""
from __future__ import annotations

import dataclasses

import ml_collections


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the message names the step and last checkpoint."""


class PreemptedError(RuntimeError):
    """A SIGTERM arrived; a checkpoint was written at the step named in the message."""


class TrainingInterrupted(KeyboardInterrupt):
    """A Ctrl-C (SIGINT) arrived; a checkpoint was written at the step named in the message.
    A KeyboardInterrupt, not an Exception: a sweep's ``except Exception: continue`` around
    ``train_and_evaluate`` does not swallow the user's Ctrl-C (a PreemptedError it would).
    ``cli.EXIT_CODES`` maps it to exit 42, as PreemptedError."""


@dataclasses.dataclass(frozen=True)
class Actions:
    """What to do after one step."""

    log: bool       # write the train summaries (and check them)
    check: bool     # check the metrics for NaN/Inf (log steps and save steps)
    evaluate: bool
    save: bool
    pause: bool     # stop_at reached before the last step: save and return
    preempt: bool   # SIGTERM or Ctrl-C: save and raise PreemptedError / TrainingInterrupted


@dataclasses.dataclass(frozen=True)
class StepPolicy:
    """``policy.after(step, preempt)`` -> the ``Actions`` of that step."""

    log_every: int
    eval_every: int
    checkpoint_every: int
    n_steps: int
    stop_at: int | None = None  # end this process after this step (the schedule runs on)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, n_steps: int,
                    stop_at: int | None = None) -> "StepPolicy":
        return cls(int(config.log_every), int(config.eval_every), int(config.checkpoint_every),
                   int(n_steps), stop_at)

    def after(self, step: int, preempt: bool = False) -> Actions:
        """``preempt``: a SIGTERM was seen (``preemption.reached``) by the end of ``step``."""
        is_last = step == self.n_steps
        pause = self.stop_at is not None and step >= self.stop_at and not is_last
        save = step % self.checkpoint_every == 0 or is_last or preempt or pause
        log = step % self.log_every == 0 or is_last
        return Actions(log=log, check=log or save,
                       evaluate=step % self.eval_every == 0 or is_last, save=save, pause=pause,
                       preempt=preempt)

"""``train_and_evaluate(config, workdir)``: the one training entry point (main.py's, and the one to
import), for every model size and every normalizer.

It owns the run's guards: the SIGTERM flag (a SIGTERM or Ctrl-C from then on ends in a
checkpoint and PreemptedError, or TrainingInterrupted for Ctrl-C, exit 42) and the workdir lock
(one live run per workdir), taken once for the whole run. Inside them: ``build.build_run``
(pipelines, model, state, writers, evaluator) and ``trainer.train`` (the steps and the
``policy.StepPolicy`` actions). Light imports only at the
top: TensorFlow (which tf.data/tfds datasets need; the summary writer does not) takes seconds to
import, and is imported under the flag.
"""
from __future__ import annotations

from typing import Any

import jax
import ml_collections
from absl import logging

from normvit_jax import distributed, preemption, run_data, run_log, sharding
from normvit_jax import workdir as workdir_lib
from normvit_jax.train import setup
from normvit_jax.train.policy import (NonFiniteError, PreemptedError, StepPolicy,
                                      TrainingInterrupted)

__all__ = ["NonFiniteError", "PreemptedError", "TrainingInterrupted", "train_and_evaluate"]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_at: int | None = None, fresh: bool = False,
                       exit_at_once: bool = False) -> dict[str, Any]:
    """Trains and evaluates; re-running with the same workdir continues from the newest checkpoint.

    ``stop_at``: end this process after that step with a checkpoint (the schedule still runs to
    the configured total), for time-sliced jobs; a re-run continues. ``fresh``: start at step 0
    even if the workdir holds a run (moved to ``workdir/replaced/``). Returns the final step, the
    last eval metrics and the state. Raises ValueError (bad config), WorkdirBusyError,
    WorkdirError, ConfigChangedError, run_data.DataChangedError (a dataset prepared again since
    the run trained), CheckpointMismatchError, DatasetNotFoundError, NonFiniteError or
    PreemptedError (cli.EXIT_CODES maps them to exit codes); Ctrl-C after the first step:
    TrainingInterrupted (a KeyboardInterrupt: a caller's ``except Exception`` does not catch
    it; exit 42 too, checkpoint written).

    ``exit_at_once`` (``cli.run``'s, for main.py): a signal with nothing to save (in start-up, or
    a second one) ends the process at once with one line (os._exit: 130 for Ctrl-C, 42 / 143 for
    SIGTERM; normvit_jax/preemption.py). Default (a library caller, e.g. a notebook): such a Ctrl-C
    raises KeyboardInterrupt here and the process lives on (SIGTERM still ends it).

    Called from Python (a notebook), it makes main.py's checks itself: ``preflight.check`` (with
    the keys of an unlocked config: a misspelt key is a ValueError, not a default) and
    ``config.reproducible_cpu_threads`` (``_pin_cpu_numerics``), before anything is written.
    """
    _start_checks(config, workdir)
    rerun = workdir_lib.rerun_advice(fresh)  # said by every line that tells how to continue
    with preemption.SigtermFlag(rerun, exit_at_once=exit_at_once) as sigterm:
        workdir = workdir_lib.absolute(workdir)
        from normvit_jax import data  # pylint: disable=import-outside-toplevel  (may import TF)
        lock, failure = None, None
        try:  # the checks that may fail on some processes only (a dataset missing on one host,
            # the lock, which process 0 alone takes): the processes agree before going on
            mesh = sharding.make_mesh(config)
            run_spec = setup.resolve_config(config, mesh.devices.size)
            lock = workdir_lib.prepare(config, workdir, fresh=fresh,
                                       process_index=jax.process_index(),
                                       data_record=run_data.of_spec(run_spec.data))
            pipelines = (data.make_pipeline(config, "train", run_spec.data),
                         data.make_pipeline(config, "eval", run_spec.data))
        except Exception as e:  # noqa: BLE001  (re-raised by agree, here or on every process)
            failure = e
        except BaseException:  # Ctrl-C: the lock goes with it, as the with-block did
            if lock is not None:
                lock.release()
            raise
        try:  # also the barrier after which process 0 has moved/written what it must
            distributed.agree("the start's checks", failure)
            distributed.check_shared_workdir(workdir)  # several processes: one folder for all
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        with lock:
            from normvit_jax.train import build, trainer  # pylint: disable=import-outside-toplevel
            log = run_log.RunLog(workdir, active=jax.process_index() == 0)
            log.start()
            sigterm.on_abrupt_exit(log.abrupt_end)  # a signal that ends the process at once
            # (start-up, a second one) records it too; once the end is recorded it does nothing
            run = None
            try:
                run = build.build_run(config, workdir, run_spec, mesh, rerun=rerun,
                                      pipelines=pipelines)
                result = trainer.train(run, StepPolicy.from_config(config, run.n_steps, stop_at),
                                       sigterm)
            except BaseException as e:
                _record_end(log, e, run)
                raise
            done = result["step"] >= run.n_steps
            log.end("finished" if done else "stopped", result["step"], 0,
                    "" if done else f"stop_at {stop_at} of {run.n_steps} steps; {rerun} to "
                    "continue")
            return result


def _start_checks(config: ml_collections.ConfigDict, workdir: str) -> None:
    """main.py's checks for a call that did not come through it: the config checks (cli.run made
    them already; they are cheap and change nothing), then the CPU numerics pinning."""
    from normvit_jax import preflight  # pylint: disable=import-outside-toplevel
    preflight.check(config, workdir)
    _pin_cpu_numerics(config)


def _pin_cpu_numerics(config: ml_collections.ConfigDict) -> None:
    """``config.reproducible_cpu_threads`` as main.py applies it, when JAX's backend has not
    started yet; pinned already (main.py, an earlier call in this process, the user's own
    environment): nothing to do; else one warning line naming the key and what to do
    (``reproducible.too_late``), and the run trains unpinned.

    A warning, not an error: the run it trains is correct, only not bit-reproducible across core
    counts, and the backend of a notebook or test process has usually started (anything that
    touched JAX starts it), where an error would make every library call with a demo config fail
    and leave only restarting the process. The warning says how to pin (a new process) or to
    record the run as unpinned (0), which keeps a later CLI resume on the same numerics."""
    from normvit_jax import reproducible  # pylint: disable=import-outside-toplevel
    threads = int(config.get("reproducible_cpu_threads") or 0)
    if not threads or reproducible.in_effect():
        return
    if not reproducible.backend_started():
        logging.info("%s", reproducible.apply(threads))
    elif jax.default_backend() == "cpu":  # GPU and TPU backends ignore the pinning
        logging.warning("%s", reproducible.too_late(threads))


def _record_end(log: run_log.RunLog, error: BaseException, run: Any) -> None:
    """The end state of a run that raised: ``preempted`` (exit 42; Ctrl-C with nothing to save,
    130) or ``failed`` with the exit code ``cli`` gives it (1 for an unexpected error: its
    traceback follows) and its first line; a start refused before any step (a known error, no
    step reached) is ``RunLog.refused`` and a Ctrl-C before this start's first step (a re-run of
    a finished run included) ``RunLog.interrupted``: status.json keeps the run's last end."""
    from normvit_jax import cli  # pylint: disable=import-outside-toplevel
    code = cli.exit_code(error)
    if code is None:  # Ctrl-C before the loop (main.py: 130), or an unexpected error (traceback)
        code = cli.EXIT_INTERRUPTED if isinstance(error, KeyboardInterrupt) else 1
    message = (str(error).strip().splitlines() or [""])[0]
    message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    step = getattr(run, "step_reached", None)
    trained = step is not None and step != getattr(run, "start_step", None)  # by this start
    if step is None and code not in (1, cli.EXIT_PREEMPTED, cli.EXIT_INTERRUPTED):
        log.refused(code, message)  # nothing trained: status.json keeps how the run last ended
    elif isinstance(error, KeyboardInterrupt) and not trained:
        log.interrupted(code, message)  # the same (none before it: preempted, no step)
    elif isinstance(error, (PreemptedError, KeyboardInterrupt)):
        log.end("preempted", step, code, message)
    else:
        log.end("failed", step, code, message)

"""SIGTERM (what Cloud TPU and SLURM send before taking a machine) and Ctrl-C (SIGINT) as a flag
the loop polls once per step, so the run finishes the step, checkpoints and exits with
``EXIT_PREEMPTED`` (42) and one line: "interrupted at step N; saved ...; rerun the same command
to resume".

One process: a Python handler sets the flag; a second SIGTERM or Ctrl-C ends the process at once
with one line (Orbax's atomic commits make that safe: a half-written checkpoint is never listed).
Several processes: JAX's distributed runtime already installs its own SIGTERM notifier and agrees
on a step across hosts (``reached_preemption_sync_point``), so no Python handler is installed
there: every host stops after the same step (Ctrl-C keeps Python's default there).

Installed by ``train_and_evaluate`` for the whole run (after ``jax.distributed.initialize``,
which ``cli.run`` calls first), before the slow imports.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_lock = threading.Lock()
_count = 0
_previous: dict[int, object] = {}
_received = False


def multi_process() -> bool:
    """True when this process is one of several (call after jax.distributed.initialize)."""
    if "jax" not in sys.modules:
        return False
    import jax
    return jax.process_count() > 1


def _name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _handle(signum, frame) -> None:
    global _received
    if _received:  # the second one: the user does not want to wait for the step and the save
        sys.stderr.write(f"{_name(signum)} again: stopped at once, nothing saved since the last "
                         "checkpoint; rerun the same command to resume from it.\n")
        sys.stderr.flush()
        os._exit(128 + signum)
    _received = True
    logging.warning("%s received: finishing this step, then saving a checkpoint and exiting "
                    "(%s again stops at once).", _name(signum), _name(signum))


class SigtermFlag:
    """Context manager: installs the handler for SIGTERM and SIGINT (main thread, one process
    only) and restores the previous ones on exit of the outermost use."""

    def __enter__(self) -> "SigtermFlag":
        global _count, _received
        with _lock:
            if _count == 0 and threading.current_thread() is threading.main_thread() \
                    and not multi_process():
                _received = False
                for s in SIGNALS:
                    _previous[s] = signal.signal(s, _handle)
            _count += 1
        return self

    def __exit__(self, *exc) -> None:
        global _count
        with _lock:
            _count -= 1
            if _count == 0:
                for s, previous in _previous.items():
                    signal.signal(s, previous)
                _previous.clear()

    @property
    def received(self) -> bool:
        return _received


def reached(flag: SigtermFlag, step: int) -> bool:
    """True when the run must checkpoint and stop after ``step``; with several processes every
    host gets True at the same step (JAX's preemption sync point, called at every step)."""
    if multi_process():
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step)
    return flag.received

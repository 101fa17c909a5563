"""SIGTERM (what Cloud TPU and SLURM send before taking a machine) as a flag the loop polls once
per step, so the run finishes the step, checkpoints and exits with ``EXIT_PREEMPTED``.

One process: a Python SIGTERM handler sets the flag; a second SIGTERM kills at once (Orbax's
atomic commits make that safe). Several processes: JAX's distributed runtime already installs its
own SIGTERM notifier and agrees on a step across hosts (``reached_preemption_sync_point``), so no
Python handler is installed there: every host stops after the same step.

Installed by ``cli.run`` right after ``jax.distributed.initialize`` (before the slow imports) and
again, re-entrantly, by the loop.
"""
from __future__ import annotations

import signal
import threading

from absl import logging

_lock = threading.Lock()
_count = 0
_previous = None
_received = False


def multi_process() -> bool:
    """True when this process is one of several (call after jax.distributed.initialize)."""
    import sys
    if "jax" not in sys.modules:
        return False
    import jax
    return jax.process_count() > 1


def _handle(signum, frame) -> None:
    global _received
    if _received:
        return
    _received = True
    logging.warning("SIGTERM received: finishing this step, then writing a checkpoint and exiting "
                    "(a second SIGTERM exits at once).")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class SigtermFlag:
    """Context manager: installs the handler (main thread, one process only) and restores the
    previous one on exit of the outermost use."""

    def __enter__(self) -> "SigtermFlag":
        global _count, _previous, _received
        with _lock:
            if _count == 0 and threading.current_thread() is threading.main_thread() \
                    and not multi_process():
                _received = False
                _previous = signal.signal(signal.SIGTERM, _handle)
            _count += 1
        return self

    def __exit__(self, *exc) -> None:
        global _count, _previous
        with _lock:
            _count -= 1
            if _count == 0 and _previous is not None:
                signal.signal(signal.SIGTERM, _previous)
                _previous = None

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

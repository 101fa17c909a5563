"""SIGTERM (what Cloud TPU and SLURM send before taking a machine) and Ctrl-C (SIGINT) as a flag
the loop polls once per step, so the run finishes the step, checkpoints and exits with
``EXIT_PREEMPTED`` (42) and one line: "interrupted at step N; saved ...; rerun the same command
to resume" (the loop raises ``PreemptedError`` for SIGTERM, ``TrainingInterrupted``, a
KeyboardInterrupt, for Ctrl-C: a caller's ``except Exception`` does not swallow the user's Ctrl-C).

One process: a Python handler sets the flag; a second SIGTERM or Ctrl-C ends the process at once
with one line (Orbax's atomic commits make that safe: a half-written checkpoint is never listed).
Several processes: JAX's distributed runtime already installs its own SIGTERM notifier and agrees
on a step across hosts (``reached_preemption_sync_point``), so no Python handler is installed
there: every host stops after the same step (Ctrl-C keeps Python's default there).

Installed by ``train_and_evaluate`` for the whole run (after ``jax.distributed.initialize``,
which ``cli.run`` calls first), before the slow imports. Until the first train step has run
(``SigtermFlag.started``) there is nothing new to save, so a signal stops the process at once with
one line: Ctrl-C exits 130, SIGTERM 42 (a scheduler requeues it). Start-up spends most of its time
in C++ (XLA compiling), where Python signal handlers wait for the call to return; a thread woken
through ``signal.set_wakeup_fd`` stops the process without waiting. The same thread ends the
process at a second signal after start-up, which must not wait either (the main thread may be in
C++ for as long as a checkpoint commit or a device step takes).

Stopping the process at once is the command line's (``SigtermFlag(exit_at_once=True)``, which
``cli.run`` asks for through ``train_and_evaluate(exit_at_once=True)``). A library caller (a
notebook's kernel, a sweep in one Python process) gets the default, ``exit_at_once=False``: a
Ctrl-C in start-up or a second Ctrl-C raises KeyboardInterrupt in the caller, as Python's own
handler would (when the running C++ call returns), and the process lives on; SIGTERM still ends
the process as above (Python's default for it ends the process too).

Before either stop at once (``os._exit``: no ``finally`` runs), the callback given to
``SigtermFlag.on_abrupt_exit`` (the run's ``run_log.RunLog.abrupt_end``) records the end, best
effort: status.json says ``preempted`` with the exit code (a signal before this start's first step
keeps the status.json the run had, adding ``last_start``), and training.log its last line.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_lock = threading.Lock()
_exit_lock = threading.Lock()  # not _lock: the handler may run while the main thread holds that
_count = 0
_previous: dict[int, object] = {}
_received = False
_signum: int | None = None  # the signal ``_received`` stands for (the first one after start-up)
_starting = False      # between the handler's installation and the end of the first train step
_wakeup: tuple[int, int, int] | None = None  # (read fd, write fd, the previous wakeup fd)
_installed: "SigtermFlag | None" = None  # the flag whose handler is installed (outermost use)
_rerun = "rerun the same command"  # how to continue: workdir.rerun_advice (without --fresh)


def multi_process() -> bool:
    """True when this process is one of several (call after jax.distributed.initialize)."""
    if "jax" not in sys.modules:
        return False
    import jax
    return jax.process_count() > 1


def _name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _exit_now(flag: "SigtermFlag", code: int, line: str, step: int | None) -> None:
    """Says ``line`` on stderr, lets ``flag``'s abrupt-exit callback record the end (best effort:
    nothing it raises stops the exit; ``step`` None: before this start's first step) and ends the
    process with ``code``."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    callback = flag.abrupt_exit_callback
    if callback is not None:
        try:
            callback(step, code, line)
        except BaseException:  # noqa: BLE001  (the process ends anyway: nothing may stop that)
            pass
    os._exit(code)


def _stop_starting(signum: int, flag: "SigtermFlag") -> None:
    """Ends the process in start-up, where nothing new can be saved (see the module docstring)."""
    with _exit_lock:
        code = 128 + signum if signum == signal.SIGINT else 42  # 42: cli.EXIT_PREEMPTED
        _exit_now(flag, code, f"{_name(signum)} while starting up (before the first step): "
                  "stopped at once; nothing new to save; rerun the same command to start again.",
                  None)


def _watch(read_fd: int, flag: "SigtermFlag") -> None:
    """Reads the signal numbers the C-level handler writes (set_wakeup_fd); in start-up, stops;
    after it, the second signal stops too. The main thread's Python handler does both as well,
    but only once the C++ call it is in returns (a held checkpoint commit, a long device step):
    a user's second Ctrl-C must not wait for that."""
    after_start_up = 0  # signals read since the first step, counted here: the handler may not
    while True:         # have run for the first one yet
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            os.close(read_fd)
            return
        for signum in data:
            # a library caller's Ctrl-C: the Python handler raises KeyboardInterrupt instead;
            # a byte read after its flag was left (and maybe another entered) is not this one's
            if _installed is not flag or signum not in SIGNALS:
                continue
            if _starting:
                if not _raises(flag, signum):
                    _stop_starting(signum, flag)
                continue
            after_start_up += 1
            if after_start_up == 1:
                continue  # the first: the Python handler's (finish the step, save)
            if _raises(flag, signum):
                _received_in_watcher(signum)
            else:
                _stop_again(signum, flag)


def _received_in_watcher(signum: int) -> None:
    """A library caller's second Ctrl-C: Python runs its handler once for Ctrl-Cs that came during
    one C++ call, which would take two for one; marked received here, that one raises."""
    global _received, _signum
    if not _received:
        _received, _signum = True, signum


def _stop_again(signum: int, flag: "SigtermFlag") -> None:
    """Ends the process at a second signal after start-up (see the module docstring)."""
    with _exit_lock:
        _exit_now(flag, 128 + signum, f"{_name(signum)} again: stopped at once, nothing saved "
                  f"since the last checkpoint; {_rerun} to resume from it.", flag.step)


def _raises(flag: "SigtermFlag", signum: int) -> bool:
    """A signal that cannot end in a checkpoint raises KeyboardInterrupt in the main thread
    instead of ending the process: Ctrl-C, for a caller that did not ask for ``exit_at_once``."""
    return signum == signal.SIGINT and not flag.exit_at_once


def _handle(flag: "SigtermFlag", signum, frame) -> None:
    global _received, _signum
    if (_starting or _received) and _raises(flag, signum):
        raise KeyboardInterrupt  # Python's default: the caller gets it, the process lives on
    if _starting:
        _stop_starting(signum, flag)
    if _received:  # the second one: the user does not want to wait for the step and the save
        _stop_again(signum, flag)
    _received, _signum = True, signum
    if flag.exit_at_once:
        then, again = "exiting", "stops at once"
    else:  # a library caller: the loop raises; a second Ctrl-C raises KeyboardInterrupt at once
        then = "raising " + ("TrainingInterrupted" if signum == signal.SIGINT else "PreemptedError")
        again = "raises KeyboardInterrupt at once" if signum == signal.SIGINT else "stops at once"
    logging.warning("%s received: finishing this step, then saving a checkpoint and %s "
                    "(%s again %s).", _name(signum), then, _name(signum), again)


class SigtermFlag:
    """Context manager: installs the handler for SIGTERM and SIGINT (main thread, one process
    only) and restores the previous ones on exit of the outermost use. ``rerun``: how to
    continue from the checkpoint a signal leaves (``workdir.rerun_advice``), for the lines
    that say it. ``exit_at_once`` (the command line's): a Ctrl-C that cannot end in a checkpoint
    (start-up, a second one) ends the process at once with one line (exit 130); without it (a
    library caller) it raises KeyboardInterrupt and the process lives on. SIGTERM ends the
    process at once either way."""

    def __init__(self, rerun: str = "rerun the same command", exit_at_once: bool = False) -> None:
        self.rerun = rerun
        self.exit_at_once = exit_at_once
        self.step: int | None = None  # the last step ``reached`` was asked about
        self.abrupt_exit_callback = None

    def on_abrupt_exit(self, callback) -> None:
        """``callback(step, exit_code, line)`` runs (best effort, any thread) just before a signal
        ends the process at once (start-up, or a second signal); ``None`` removes it."""
        self.abrupt_exit_callback = callback

    def __enter__(self) -> "SigtermFlag":
        global _count, _received, _signum, _starting, _wakeup, _rerun, _installed
        with _lock:
            if _count == 0 and threading.current_thread() is threading.main_thread() \
                    and not multi_process():
                _received, _signum, _starting, _rerun = False, None, True, self.rerun
                _installed = self
                for s in SIGNALS:
                    _previous[s] = signal.signal(s, functools.partial(_handle, self))
                r, w = os.pipe()
                os.set_blocking(w, False)  # set_wakeup_fd requires it; the reader blocks
                _wakeup = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
                threading.Thread(target=_watch, args=(r, self), daemon=True,
                                 name="normvit-signal-watch").start()
            _count += 1
        return self

    def __exit__(self, *exc) -> None:
        global _count, _starting, _wakeup, _installed
        with _lock:
            _count -= 1
            if _count == 0:
                _starting, _installed = False, None
                for s, previous in _previous.items():
                    signal.signal(s, previous)
                _previous.clear()
                if _wakeup is not None:
                    r, w, old = _wakeup
                    signal.set_wakeup_fd(old)
                    os.close(w)  # the watcher reads EOF and returns; it owns the read end
                    _wakeup = None

    def started(self) -> None:
        """The first train step has run: from now on a signal ends in a checkpoint (exit 42)."""
        global _starting
        _starting = False

    @property
    def received(self) -> bool:
        return _received

    @property
    def signum(self) -> int | None:
        """The signal that set the flag (``signal.SIGINT``: Ctrl-C), None before one."""
        return _signum if _received else None


def reached(flag: SigtermFlag, step: int) -> bool:
    """True when the run must checkpoint and stop after ``step``; with several processes every
    host gets True at the same step (JAX's preemption sync point, called at every step)."""
    flag.step = step
    if multi_process():
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step)
    return flag.received

"""How a training run went, in its workdir: ``training.log`` and ``status.json``.

stdout was the only log of a run, and a workdir told nothing of how its last process ended: the
lock is emptied on every way out, so a finished run and a preempted one looked alike, and a
killed one left only its pid in ``.lock``. Process 0 of a training start (from the moment it holds
the workdir's lock) therefore

- appends its log lines, as printed, to ``workdir/training.log``, after one separator line naming the
  start (UTC time, pid, host, the command line): a resume appends below the earlier starts. A
  library call (``train_and_evaluate`` from Python, absl not set up by absl.app: WARNING) writes
  the same lines: the absl logger passes INFO while the file is open (what the caller's level
  drops goes to the file only), the file drops Orbax's chatter itself, and the caller's logging
  is as it was after;
- writes ``workdir/status.json`` (atomically): ``{"state": "running", ...}`` at the start, and at
  the end one of ``finished`` (the last step), ``stopped`` (``stop_at``), ``preempted`` (SIGTERM
  or Ctrl-C, exit 42) or ``failed`` (an error: its exit code and one-line message), with the
  step reached, and logs the same as the last line of the log (``Run ended: ...``). A process
  killed outright (SIGKILL, power loss) leaves ``running``: with the lock free (its process gone)
  that is a run that was killed. A signal that ends the process at once (in start-up, or a second
  one: ``preemption``) records ``preempted`` with its exit code (42, or 130 for Ctrl-C in
  start-up; 128 + the signal's number for a second one) through ``abrupt_end``; a signal before
  this start's first step (``abrupt_end``, or a library caller's Ctrl-C: ``interrupted``) keeps
  the status.json the run had before it, adding ``last_start`` {"state": "preempted", ...}: an
  interrupted re-run of a finished run still says ``finished``.
- A start refused inside the lock before it trained a step (a checkpoint that does not fit, gone
  checkpoints, a config change refused: ``refused``) is one line in training.log; status.json
  keeps how the run last ended and adds ``last_start`` (time, exit code, message): a refused
  re-run of a finished run still says ``finished``. With no status.json before it, such a start
  leaves no record: it removes the status.json it wrote and its lines of training.log (the file
  when it had none before), so a failed start leaves nothing to clean up.

A remote (gs://) workdir gets status.json but no training.log (a log file is appended line by line).
Never a new failure mode: an error writing either (a full disk) is one warning line and the run goes
on; training.log gets nothing more after its first failed write. The
tools (``--mode=eval``, analysis, predict, export) read neither.
"""
from __future__ import annotations

import datetime
import json
import logging as std_logging
import os
import socket
import sys
from typing import Any

from absl import logging
from etils import epath

from normvit_jax import logs

LOG_NAME = "training.log"
STATUS_NAME = "status.json"


def _utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_status(workdir: str, state: str, **fields: Any) -> None:
    """Replaces ``workdir/status.json`` with ``{"state": state, **fields, "time", "pid", "host"}``
    (written to a temporary name, then renamed); an error is one warning line."""
    _write_record(workdir, {"state": state, **fields, "time": _utc(), "pid": os.getpid(),
                            "host": socket.gethostname()})


def _write_record(workdir: str, record: dict[str, Any]) -> None:
    tmp = epath.Path(workdir) / f".{STATUS_NAME}.tmp"
    try:
        path = epath.Path(workdir) / STATUS_NAME
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
    except Exception as e:  # noqa: BLE001  (never a failed run for its status record)
        logging.warning("Cannot write %s in %s (%s: %s).", STATUS_NAME, workdir,
                        type(e).__name__, e)
        try:  # a full disk left a partial temporary file: not one more thing to clean up
            tmp.unlink(missing_ok=True)
        except Exception:  # noqa: BLE001
            pass


def read_status(workdir: str) -> dict[str, Any] | None:
    try:
        return json.loads((epath.Path(workdir) / STATUS_NAME).read_text())
    except (OSError, ValueError):
        return None


class _LogFileHandler(std_logging.FileHandler):
    """Appends to training.log and fails once: at the first write that fails (a full disk, a
    folder made read-only) one warning line, and the file gets nothing more (no stdlib
    '--- Logging error ---' block per record); ``close`` never raises. The log still goes to
    stderr."""

    def __init__(self, path: str):
        super().__init__(path, mode="a", encoding="utf-8")
        self.broken = False

    def write_raw(self, text: str) -> bool:
        """Writes ``text`` as it is; False (after the one warning) when it fails."""
        if self.broken:
            return False
        try:
            self.stream.write(text)
            self.stream.flush()
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return False
        return True

    def emit(self, record: std_logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: std_logging.LogRecord) -> None:  # noqa: N802 (stdlib's name)
        self._fail(sys.exc_info()[1])

    def flush(self) -> None:
        if self.broken:
            return
        try:
            super().flush()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def close(self) -> None:
        try:
            super().close()
        except Exception:  # noqa: BLE001  (a full disk: the unwritten lines were warned of)
            pass

    def _fail(self, e: BaseException | None) -> None:
        if self.broken:
            return
        self.broken = True
        try:
            self.stream.close()
        except Exception:  # noqa: BLE001
            pass
        logging.warning("Cannot write %s (%s: %s); the log goes to stderr only from here.",
                        self.baseFilename, type(e).__name__, e)


class _OnlyToFile(std_logging.Filter):
    """On the absl logger while a run's log is open in a process whose absl level was above
    INFO: a record below that level goes to training.log only (not to the caller's handlers,
    which would not have seen it)."""

    def __init__(self, handler: std_logging.Handler, level: int):
        super().__init__()
        self.handler, self.level = handler, level

    def filter(self, record: std_logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            return True
        if record.levelno >= self.handler.level:
            self.handler.handle(record)
        return False


class RunLog:
    """``start()`` when the run holds its lock, ``end(state, ...)`` on every way out (process 0;
    other processes: make it with ``active=False``, and it does nothing)."""

    def __init__(self, workdir: str, active: bool = True):
        self.workdir = workdir
        self.active = active
        self._handler: std_logging.Handler | None = None
        # the absl logger's level before ``_attach`` raised it, and the filter it added
        self._restore: tuple[int, std_logging.Filter] | None = None
        self._ended = False
        self._previous: dict[str, Any] | None = None  # status.json before this start
        self._log_size: int | None = None  # training.log's size before this start (None: absent)

    def start(self, step: int | None = None) -> None:
        if not self.active:
            return
        self._previous = read_status(self.workdir)
        try:
            self._log_size = os.path.getsize(os.path.join(self.workdir, LOG_NAME))
        except OSError:
            self._log_size = None
        from normvit_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
        if not workdir_lib.is_remote(self.workdir):
            try:
                handler = _LogFileHandler(os.path.join(self.workdir, LOG_NAME))
            except OSError as e:
                logging.warning("Cannot open %s in %s (%s); the log goes to stderr only.",
                                LOG_NAME, self.workdir, e)
            else:
                handler.setFormatter(logging.PythonFormatter())
                # the absl logger's own filters (logs.quiet_library_logs) apply before it; its
                # own filter keeps Orbax's chatter out where they are not set (a library call)
                handler.addFilter(logs.QuietLibraries())
                if handler.write_raw(f"----- training start at {_utc()}: pid {os.getpid()} on "
                                     f"host {socket.gethostname()}: {' '.join(sys.argv)}\n"):
                    self._attach(handler)
        write_status(self.workdir, "running", **({} if step is None else {"step": step}))

    def end(self, state: str, step: int | None, exit_code: int, message: str = "") -> None:
        """Logs 'Run ended: <state> at step N (exit C).' and records it with ``message`` in
        status.json; then stops appending to training.log. The message goes under that line in
        the file only: on stderr the error's own one line follows (cli), after this file closed."""
        if not self.active or self._ended:
            return
        self._ended = True
        where = "" if step is None else f" at step {step}"
        logging.info("Run ended: %s%s (exit %d).", state, where, exit_code)
        if message and self._handler is not None:
            self._handler.write_raw(f"    {message}\n")
        write_status(self.workdir, state, step=step, exit_code=exit_code,
                     **({"message": message} if message else {}))
        self._close_handler()

    def refused(self, exit_code: int, message: str) -> None:
        """The end of a start refused before it trained a step: 'Start refused (exit C); ...' and
        ``message`` in training.log; status.json gets back the record it had before this start
        (how the run last ended), with ``last_start``; with none before, ``failed``."""
        if not self.active or self._ended:
            return
        previous = self._previous
        if previous is None:  # no run record before: this start leaves none (nothing to clean up)
            self._ended = True
            logging.info("Start refused (exit %d): nothing trained.", exit_code)
            self._close_handler()
            self._remove_own_records()
            return
        self._ended = True
        logging.info("Start refused (exit %d): nothing trained; status.json still says the run's "
                     "last end (%s).", exit_code, previous.get("state"))
        if message and self._handler is not None:
            self._handler.write_raw(f"    {message}\n")
        self._keep_previous("refused", exit_code, message)
        self._close_handler()

    def interrupted(self, exit_code: int, message: str) -> None:
        """The end of a start a signal stopped before its first step (nothing trained or saved:
        a library caller's Ctrl-C, raised as KeyboardInterrupt): with a status.json before this
        start, that record stays (how the run last ended: a re-run of a finished run still says
        ``finished``) with ``last_start`` {"state": "preempted", ...}; with none, ``end``
        ("preempted", no step)."""
        if not self.active or self._ended:
            return
        previous = self._previous
        if previous is None:
            self.end("preempted", None, exit_code, message)
            return
        self._ended = True
        logging.info("%s", self._kept_line(exit_code))
        if message and self._handler is not None:
            self._handler.write_raw(f"    {message}\n")
        self._keep_previous("preempted", exit_code, message)
        self._close_handler()

    def _kept_line(self, exit_code: int) -> str:
        return (f"Run ended: preempted (exit {exit_code}) before its first step; status.json still "
                f"says the run's last end ({(self._previous or {}).get('state')}).")

    def _keep_previous(self, state: str, exit_code: int, message: str) -> None:
        """status.json: the record it had before this start, with this start in ``last_start``."""
        _write_record(self.workdir, {**(self._previous or {}), "last_start": {
            "state": state, "time": _utc(), "pid": os.getpid(), "host": socket.gethostname(),
            "exit_code": exit_code, **({"message": message} if message else {})}})

    def _attach(self, handler: "_LogFileHandler") -> None:
        """Adds ``handler`` to the absl logger, which must pass INFO records for training.log to
        hold main.py's lines. Under absl.app (its handler on the root logger: main.py, the
        tools) the levels are the command line's (--verbosity) and the file holds what is
        printed, as ever. A library call (absl not set up: WARNING, and the file held only its
        separator lines) gets the absl logger at INFO for the run, and a filter sends what the
        caller's level would have dropped to this file alone (the caller's own handlers see what
        they saw before); ``_close_handler`` undoes both."""
        absl_logger = logging.get_absl_logger()
        absl_logger.addHandler(handler)
        self._handler = handler
        caller_level = absl_logger.getEffectiveLevel()
        under_absl_app = logging.get_absl_handler() in std_logging.getLogger().handlers
        if not under_absl_app and caller_level > std_logging.INFO:
            self._restore = (absl_logger.level, _OnlyToFile(handler, caller_level))
            absl_logger.addFilter(self._restore[1])
            absl_logger.setLevel(std_logging.INFO)

    def _close_handler(self) -> None:
        if self._handler is not None:
            absl_logger = logging.get_absl_logger()
            absl_logger.removeHandler(self._handler)
            if self._restore is not None:
                level, only_to_file = self._restore
                absl_logger.removeFilter(only_to_file)
                absl_logger.setLevel(level)
                self._restore = None
            self._handler.close()
            self._handler = None

    def _remove_own_records(self) -> None:
        """Removes the status.json this start wrote and its training.log lines (the file itself
        when it did not exist before); an error is one warning line."""
        from normvit_jax import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
        try:
            (epath.Path(self.workdir) / STATUS_NAME).unlink(missing_ok=True)
            if not workdir_lib.is_remote(self.workdir):
                log_path = os.path.join(self.workdir, LOG_NAME)
                if self._log_size is None:
                    if os.path.exists(log_path):
                        os.remove(log_path)
                else:
                    os.truncate(log_path, self._log_size)
        except Exception as e:  # noqa: BLE001  (never a new failure for its records)
            logging.warning("Cannot remove this start's %s/%s in %s (%s: %s).", LOG_NAME,
                            STATUS_NAME, self.workdir, type(e).__name__, e)

    def abrupt_end(self, step: int | None, exit_code: int, message: str) -> None:
        """``end("preempted", ...)`` for a process about to end at once (``os._exit``, from a
        signal handler or its watcher thread): writes the log line straight to the file (not
        through the logger, whose locks another thread may hold) and status.json. ``step`` None:
        before this start's first step, so a status.json from before this start stays, with
        ``last_start`` (as ``interrupted``). Never raises."""
        try:
            if not self.active or self._ended:
                return
            self._ended = True
            keep = step is None and self._previous is not None
            where = "" if step is None else f" at step {step}"
            line = self._kept_line(exit_code) if keep else \
                f"Run ended: preempted{where} (exit {exit_code})."
            handler = self._handler
            if handler is not None:
                record = std_logging.LogRecord("absl", std_logging.INFO, __file__, 0, line,
                                               None, None)
                handler.stream.write(f"{handler.format(record)}\n    {message}\n")
                handler.stream.flush()
            if keep:
                self._keep_previous("preempted", exit_code, message)
            else:
                write_status(self.workdir, "preempted", step=step, exit_code=exit_code,
                             message=message)
        except BaseException:  # noqa: BLE001  (the process is ending: nothing may stop that)
            pass

"""Guards around a run's workdir, cheap enough to run before JAX's first computation:
writability, the one-run-per-workdir lock, and moving an old run aside for ``--fresh``;
``prepare`` runs them with the saved config's check (``run_config``).

No JAX here. Google Cloud credentials for gs:// paths are checked earlier, by ``preflight``.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
from typing import Any

from absl import logging
from etils import epath

from normvit_jax import run_code, run_config, run_data, run_log
from normvit_jax.run_config import CONFIG_NAME, REPLACED_DIR, utc_stamp

LOCK_NAME = ".lock"


class WorkdirError(RuntimeError):
    """The workdir cannot be used: not writable, no credentials, disk full during a save."""


class WorkdirBusyError(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirLayoutError(ValueError):
    """A part of a run's workdir has the wrong shape: a file where its checkpoint folder belongs,
    a folder where its lock file belongs, a symbolic link that leads nowhere. One line, exit 2
    (the run's content is damaged, as a damaged config.json is; nothing is moved)."""


def not_a_folder(path: Any) -> str | None:
    """What a local ``path`` that should be a folder is instead: 'is a file, not a directory',
    'is a symbolic link loop (-> T)', 'is a symbolic link to T, which does not exist'; None for a
    folder, a path that does not exist, or a remote path."""
    path = str(path)
    if is_remote(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        target = os.readlink(path)
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"is a symbolic link loop (-> {target})"
        return f"is a symbolic link to {target}, which does not exist"
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    return None


def absolute(workdir: str) -> str:
    """Orbax needs absolute paths; remote paths (gs://...) are left as they are."""
    workdir = str(workdir)
    return workdir if is_remote(workdir) else os.path.abspath(workdir)


def is_remote(workdir: str) -> bool:
    return "://" in str(workdir)


# ----------------------------------------------------------------------------------- writable


def check_writable(workdir: str, remote_timeout_s: float = 120.0) -> None:
    """Creates ``workdir`` and writes a probe file in it, or raises WorkdirError saying why
    (a remote one within ``remote_timeout_s``; its credentials: ``preflight``)."""
    if is_remote(workdir):
        _with_deadline(lambda: _probe(workdir), remote_timeout_s,
                       f"writing to {workdir} did not finish within {remote_timeout_s:.0f} s")
    else:
        _probe(workdir)


def _probe(workdir: str) -> None:
    path = epath.Path(workdir)
    probe = path / f".write_probe.{socket.gethostname()}.{os.getpid()}"
    problem = not_a_folder(workdir)  # a file, a symbolic link loop: not "fix its permissions"
    if problem:
        raise WorkdirError(f"the workdir {workdir} {problem}; pass another --workdir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        try:
            probe.write_text("ok")
        except BaseException:  # a full disk made the file and failed its write: not left behind
            try:
                probe.unlink(missing_ok=True)
            except Exception:  # noqa: BLE001  (the write's error is the one to tell)
                pass
            raise
        probe.unlink()
    except Exception as e:  # noqa: BLE001  (OSError locally, various for gs://)
        full = getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
        raise WorkdirError(f"the workdir {workdir} is not writable ({type(e).__name__}: {e}); "
                           + ("free disk space" if full else "fix its permissions")
                           + " or pass another --workdir") from e


def _with_deadline(fn, seconds: float, message: str) -> None:
    out: list[BaseException | None] = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if not out:
        raise WorkdirError(message)
    if out[0] is not None:
        raise out[0]


# ----------------------------------------------------------------------------------- lock

_held: dict[str, list] = {}  # workdir -> [file object, count]: re-entrant within a process
_held_guard = threading.Lock()


class WorkdirLock:
    """An exclusive ``flock`` on ``workdir/.lock`` for the life of the run (``acquire``, then
    ``release`` or leave a with-block).

    The kernel drops the lock when its process dies (SIGKILL included), so a crashed run never
    blocks its re-run. ``train_and_evaluate`` holds it for the whole run; re-entrant within one
    process (a caller already holding it may start a run). Remote workdirs have no lock: a
    warning says so.
    """

    def __init__(self, workdir: str):
        self.workdir = absolute(workdir)
        self._active = False

    def __enter__(self) -> "WorkdirLock":  # acquire() first; the with-block releases
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if is_remote(self.workdir):
            logging.warning("No lock on remote workdir %s: make sure no other job uses it.",
                            self.workdir)
            return
        with _held_guard:
            if self.workdir in _held:
                _held[self.workdir][1] += 1
                self._active = True
                return
            path = os.path.join(self.workdir, LOCK_NAME)
            if os.path.isdir(path):
                raise WorkdirLayoutError(
                    f"{path} is a folder, not the run's lock file: move it away (it is no part "
                    "of the run; the lock is an empty file) and rerun the same command")
            # undecodable bytes are garbage like any other: the owner line is only shown
            f = open(path, "a+", encoding="utf-8", errors="replace")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                f.seek(0)
                owner = f.read().strip() or "an unknown process"
                f.close()
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    raise WorkdirBusyError(
                        f"the workdir {self.workdir} is in use by {owner}: stop that run first or "
                        "pass another --workdir (the lock goes away when its process ends)") from e
                raise WorkdirError(f"cannot lock {path}: {e}") from e
            f.seek(0)
            previous = f.read().strip()
            if previous:  # a run that did not release it (killed, crashed, power lost)
                logging.info("Taking over %s from %s, which has ended.", path, previous)
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on host {socket.gethostname()} (since {utc_stamp()})\n")
            f.flush()
            _held[self.workdir] = [f, 1]
            self._active = True

    def release(self) -> None:
        if not self._active:
            return
        self._active = False
        with _held_guard:
            entry = _held.get(self.workdir)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.workdir]
                try:  # a run that ended here leaves no owner: the next start takes over nothing
                    entry[0].seek(0)
                    entry[0].truncate()
                except OSError:
                    pass
                entry[0].close()  # closing the file drops the flock


def rerun_advice(fresh: bool) -> str:
    """How to continue a run from its newest checkpoint: the command that started it, less
    ``--fresh`` (run again, that would move the checkpoint aside and start over at step 0)."""
    return "rerun the same command without --fresh" if fresh else "rerun the same command"


def remove_if_unused(workdir: str) -> bool:
    """A workdir that a failed start created and left holding only its released (empty) lock and
    perhaps the checkpoint manager's empty folder (an init_from file that did not load) is removed,
    so that the corrected command starts as on a new folder and ``ls runs/`` shows no run that
    never was. Anything else in it, a lock with an owner, a remote path: kept (False)."""
    if is_remote(workdir) or not os.path.isdir(workdir):
        return False
    lock = os.path.join(workdir, LOCK_NAME)
    ckpt = os.path.join(workdir, "checkpoints")  # the checkpoint manager's folder, still empty
    # a start that failed inside the lock also left its log and status (run_log): no run either
    records = (run_log.LOG_NAME, run_log.STATUS_NAME)
    if set(os.listdir(workdir)) - {LOCK_NAME, "checkpoints", *records}:
        return False
    try:
        if os.path.exists(ckpt) and (not os.path.isdir(ckpt) or os.listdir(ckpt)):
            return False
        if os.path.exists(lock) and os.path.getsize(lock):
            return False
        if os.path.exists(ckpt):
            os.rmdir(ckpt)
        if os.path.exists(lock):
            os.remove(lock)
        for name in records:
            if os.path.exists(os.path.join(workdir, name)):
                os.remove(os.path.join(workdir, name))
        os.rmdir(workdir)
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------------- fresh


def move_run_aside(workdir: str) -> str | None:
    """For ``--fresh``: moves checkpoints, config, class names, input statistics, the code history,
    training.log and status.json (the new run starts its own), event files and ``--mode=eval`` results of the run in
    ``workdir`` to ``workdir/replaced/<UTC time>/`` (nothing is deleted). Returns that folder,
    or None if the workdir held no run."""
    root = epath.Path(workdir)
    names = [p.name for p in root.iterdir()] if root.exists() else []
    moving = [n for n in names if n in ("checkpoints", CONFIG_NAME, "damaged_checkpoints",
                                        "classes.json", run_data.RECORD_NAME,
                                        run_code.HISTORY_NAME, run_log.LOG_NAME,
                                        run_log.STATUS_NAME)
              or n.startswith(("events.out.tfevents", "config.before-", "data.before-"))
              or (n.startswith("eval_") and n.endswith((".json", ".png")))]  # --mode=eval's
    if not moving:
        return None
    dest = root / REPLACED_DIR / utc_stamp()
    dest.mkdir(parents=True, exist_ok=True)
    for n in moving:
        (root / n).rename(dest / n)
    logging.warning("--fresh: moved the previous run in %s (%s) to %s.", workdir,
                    ", ".join(sorted(moving)), dest)
    return str(dest)


def prepare(config: Any, workdir: str, *, fresh: bool = False, process_index: int = 0,
            data_record: dict | None = None) -> WorkdirLock:
    """Every check that needs no JAX, in order: writable, lock, --fresh, config, data (the
    ``run_data`` record of the dataset as it is now, ``data_record``: a dataset prepared again
    since the run trained is refused). Returns the held lock (release it, or use it as a
    with-block). Only process 0 locks and moves files; the loop writes config.json and data.json
    later (``write_config``, ``run_data.write``)."""
    workdir = absolute(workdir)
    check_writable(workdir)
    lock = WorkdirLock(workdir)
    if process_index == 0:
        lock.acquire()
    try:
        if fresh and process_index == 0:
            move_run_aside(workdir)
        if not (fresh and process_index != 0):  # they would read the config before it moves
            run_config.check_config(config, workdir)
            if data_record is not None:
                run_data.check_resume(workdir, data_record,
                                      bool(config.get("allow_config_change")))
    except BaseException:
        lock.release()
        raise
    return lock

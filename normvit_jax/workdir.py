"""Guards around a run's workdir, cheap enough to run before JAX and TensorFlow are imported:
writability (and Google Cloud credentials for gs://), the one-run-per-workdir lock, the saved
config and its diff, and moving an old run aside for ``--fresh``.

No JAX here: ``cli.run`` calls ``prepare`` first so that a busy, unwritable or changed workdir is
refused in about a second.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import urllib.request
from typing import Any

from absl import logging
from etils import epath

LOCK_NAME = ".lock"
CONFIG_NAME = "config.json"
REPLACED_DIR = "replaced"          # --fresh moves an old run here
# Keys that may differ between the saved config and a re-run without allow_config_change: the
# mesh only places the same state on devices (checkpoints restore onto any mesh).
ALWAYS_CHANGEABLE = ("allow_config_change", "mesh.data", "mesh.fsdp", "mesh.fsdp_min_size")


class WorkdirError(RuntimeError):
    """The workdir cannot be used: not writable, no credentials, disk full during a save."""


class WorkdirBusyError(RuntimeError):
    """Another live process holds the workdir's lock."""


class ConfigChangedError(ValueError):
    """The workdir holds a run made with another config."""


def absolute(workdir: str) -> str:
    """Orbax needs absolute paths; remote paths (gs://...) are left as they are."""
    workdir = str(workdir)
    return workdir if is_remote(workdir) else os.path.abspath(workdir)


def is_remote(workdir: str) -> bool:
    return "://" in str(workdir)


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


# ----------------------------------------------------------------------------------- writable


def check_writable(workdir: str, remote_timeout_s: float = 120.0) -> None:
    """Creates ``workdir`` and writes a probe file in it, or raises WorkdirError saying why."""
    if is_remote(workdir):
        check_gcs_credentials(workdir)
        _with_deadline(lambda: _probe(workdir), remote_timeout_s,
                       f"writing to {workdir} did not finish within {remote_timeout_s:.0f} s")
    else:
        _probe(workdir)


def _probe(workdir: str) -> None:
    path = epath.Path(workdir)
    probe = path / f".write_probe.{socket.gethostname()}.{os.getpid()}"
    if path.exists() and not path.is_dir():
        raise WorkdirError(f"the workdir {workdir} is a file, not a directory; pass another "
                           "--workdir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # noqa: BLE001  (OSError locally, various for gs://)
        raise WorkdirError(f"the workdir {workdir} is not writable ({type(e).__name__}: {e}); "
                           "fix its permissions or pass another --workdir") from e


def check_gcs_credentials(path: str, what: str = "the workdir") -> None:
    """Google Cloud credentials come from GOOGLE_APPLICATION_CREDENTIALS, gcloud's application
    default credentials, or the metadata server of a Cloud VM; without any, GCS clients retry for
    minutes before failing (or end in a long TensorFlow traceback), so this fails at once instead.
    ``what`` names the setting that holds ``path`` (the workdir, config.init_from, ...)."""
    if not path.startswith("gs://"):
        return
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key and os.path.exists(key):
        return
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    if os.path.exists(os.path.join(gcloud, "application_default_credentials.json")):
        return
    host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP") \
        or "metadata.google.internal"
    try:
        req = urllib.request.Request(f"http://{host}/computeMetadata/v1/",
                                     headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=2):
            return
    except Exception:  # noqa: BLE001  (no metadata server: not on a Cloud VM)
        pass
    raise WorkdirError(
        f"{what} {path}: no Google Cloud credentials found (GOOGLE_APPLICATION_CREDENTIALS is "
        f"{'set to a missing file' if key else 'unset'}, no application default credentials in "
        f"{gcloud}, no metadata server at {host}). Run `gcloud auth application-default login`, "
        "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key, or run on a Cloud VM.")


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
    blocks its re-run. Re-entrant within one process (cli.run and train_and_evaluate both take
    it). Remote workdirs have no lock: a warning says so.
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
            f = open(path, "a+")
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
            if previous:
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
                entry[0].close()  # closing the file drops the flock


# ----------------------------------------------------------------------------------- config


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flat_values(config: Any) -> dict:
    """A ConfigDict's values by dotted key ('data.image_size'), as its JSON has them."""
    return _flatten(json.loads(config.to_json_best_effort()))


def _default_values() -> dict:
    """Flattened values of configs/default.py: a key a newer version added is absent from an
    older run's config.json; at its default it keeps the old behaviour, so it is no change."""
    from configs import default  # pylint: disable=import-outside-toplevel
    return flat_values(default.get_config())


def config_diff(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    defaults = _default_values() if defaults is None else defaults

    def changed(k: str) -> bool:
        if k in ALWAYS_CHANGEABLE or a.get(k) == b.get(k):
            return False
        return not (k not in a and k in defaults and b.get(k) == defaults[k])

    return [f"  {k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if changed(k)]


def check_config(config: Any, workdir: str) -> None:
    """Refuses a workdir whose config.json differs from ``config`` (with a diff of the changed
    keys) unless ``config.allow_config_change``."""
    path = epath.Path(workdir) / CONFIG_NAME
    if not path.exists():
        return
    diff = config_diff(json.loads(path.read_text()), json.loads(config.to_json_best_effort()))
    if diff and not has_checkpoint(workdir):
        # An earlier start failed before its first checkpoint (a wrong init_from, data not yet
        # prepared): nothing was trained with the old config, so the corrected command goes on;
        # write_config keeps the old file as config.before-<time>.json.
        logging.warning("%s has no checkpoint yet: taking the new config (changed keys:\n%s)",
                        workdir, "\n".join(diff))
        return
    if diff and not config.get("allow_config_change"):
        raise ConfigChangedError(
            f"{workdir} holds a run made with another config; changed keys:\n" + "\n".join(diff)
            + "\nUse another --workdir, pass --config.allow_config_change=True to continue "
              "this run with the new values, or --fresh to start over (the old run is moved "
              f"to {REPLACED_DIR}/).")


def has_checkpoint(workdir: str) -> bool:
    """Whether ``workdir/checkpoints`` holds a step folder (complete or not: a partial one means
    training ran with the saved config)."""
    root = epath.Path(workdir) / "checkpoints"
    return root.exists() and any(p.name.split(".")[0].isdigit() for p in root.iterdir())


def write_config(config: Any, workdir: str) -> None:
    """Writes config.json (atomically). Called once the run's checkpoint restored or it starts
    at step 0, so a change refused later (a model that no longer fits) leaves it untouched. An
    accepted change keeps the old file as config.before-<time>.json."""
    path = epath.Path(workdir) / CONFIG_NAME
    current = json.loads(config.to_json_best_effort())
    if path.exists():
        old = path.read_text()
        diff = config_diff(json.loads(old), current)
        if not diff:
            return
        if has_checkpoint(workdir):
            logging.warning("Continuing %s with a changed config (allow_config_change):\n%s",
                            workdir, "\n".join(diff))
        (path.parent / f"config.before-{utc_stamp()}.json").write_text(old)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True))
    tmp.replace(path)


def write_json_atomic(workdir: str, name: str, value: Any) -> None:
    """``<workdir>/<name>`` = JSON of ``value``, written to a temporary name and renamed."""
    path = epath.Path(workdir) / name
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    tmp.replace(path)


def check_or_write_config(config: Any, workdir: str) -> None:
    """Both of the above (for callers that do not restore in between)."""
    check_config(config, workdir)
    write_config(config, workdir)


# ----------------------------------------------------------------------------------- fresh


def move_run_aside(workdir: str) -> str | None:
    """For ``--fresh``: moves checkpoints, config, class names, event files and ``--mode=eval``
    results of the run in ``workdir`` to ``workdir/replaced/<UTC time>/`` (nothing is deleted).
    Returns that folder, or None if the workdir held no run."""
    root = epath.Path(workdir)
    names = [p.name for p in root.iterdir()] if root.exists() else []
    moving = [n for n in names if n in ("checkpoints", CONFIG_NAME, "damaged_checkpoints",
                                        "classes.json")
              or n.startswith(("events.out.tfevents", "config.before-"))
              or (n.startswith("eval_") and n.endswith(".json"))]  # --mode=eval's results
    if not moving:
        return None
    dest = root / REPLACED_DIR / utc_stamp()
    dest.mkdir(parents=True, exist_ok=True)
    for n in moving:
        (root / n).rename(dest / n)
    logging.warning("--fresh: moved the previous run in %s (%s) to %s.", workdir,
                    ", ".join(sorted(moving)), dest)
    return str(dest)


def prepare(config: Any, workdir: str, *, fresh: bool = False, process_index: int = 0
            ) -> WorkdirLock:
    """Every check that needs no JAX, in order: writable, lock, --fresh, config. Returns the held
    lock (release it, or use it as a with-block). Only process 0 locks and moves files; the
    loop writes config.json later (``write_config``)."""
    workdir = absolute(workdir)
    check_writable(workdir)
    lock = WorkdirLock(workdir)
    if process_index == 0:
        lock.acquire()
    try:
        if fresh and process_index == 0:
            move_run_aside(workdir)
        if not (fresh and process_index != 0):  # they would read the config before it moves
            check_config(config, workdir)
    except BaseException:
        lock.release()
        raise
    return lock

"""Which code trained which steps: ``workdir/code.jsonl``, one line per training start.

A fix that changes the update rule (which parameters get weight decay, say) makes a run resumed
across it take other steps from the resume on, with nothing in the checkpoint to show it. Each
start (process 0) appends the code that runs (normvit_jax's version, the git commit of a source
checkout and whether it was dirty, the versions of the numerical libraries) with the step it
starts from; a resume whose code differs from the previous start's says so in one warning line
and trains on. Never a new failure mode: the start's own checks already refuse an unwritable
workdir, so any error here is logged and the run continues. No JAX here.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from typing import Any

from absl import logging
from etils import epath

from normvit_jax import run_config

HISTORY_NAME = "code.jsonl"
PACKAGES = ("normvit_jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
GIT_TIMEOUT_S = 5.0  # a hung network filesystem or a huge tree must not hold up the start
# the source tree: normvit_jax/.. (a git checkout) or site-packages (a pip-installed copy)
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", SOURCE_ROOT, *args], capture_output=True, text=True,
                             timeout=GIT_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):  # no git, not a repo, timed out
        return None
    return out.stdout.strip()


def current() -> dict[str, Any]:
    """The code of this process: ``versions`` by package and, for a git checkout, ``commit``
    and ``dirty`` (tracked files changed since the commit)."""
    code: dict[str, Any] = {"versions": {p: _version(p) for p in PACKAGES}}
    # only the project's own checkout: site-packages inside some other repository is not ours
    if os.path.exists(os.path.join(SOURCE_ROOT, ".git")):
        commit = _git("rev-parse", "HEAD")
        if commit:
            code["commit"] = commit
            status = _git("status", "--porcelain", "--untracked-files=no")
            if status is not None:
                code["dirty"] = bool(status)
    return code


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two records, as 'commit 2150f00 -> 6e0ab85', 'jax 0.10.2 -> 0.11.2'.
    A commit on one side only (a pip-installed copy on the other) is a change too."""
    out = []
    if old.get("commit") != new.get("commit"):
        out.append(f"commit {(old.get('commit') or 'none')[:7]} -> "
                   f"{(new.get('commit') or 'none')[:7]}")
    ov, nv = old.get("versions") or {}, new.get("versions") or {}
    out += [f"{p} {ov.get(p)} -> {nv.get(p)}" for p in PACKAGES if ov.get(p) != nv.get(p)]
    return out


def _last(text: str) -> dict | None:
    """The newest readable entry of the history's ``text``; a damaged line (edited by hand, a
    full disk) is skipped."""
    for line in reversed(text.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            return entry
    return None


def record_start(workdir: str, step: int) -> None:
    """Appends this start (``step``: the step training continues from, 0 for a new run) to
    code.jsonl and warns once when the code differs from the previous start's. Process 0 only."""
    try:
        path = epath.Path(workdir) / HISTORY_NAME
        old_text = path.read_text() if path.exists() else ""  # none: a new run, or an older one
        previous = _last(old_text)
        entry = {"step": int(step), "time": run_config.utc_stamp(), **current()}
        if previous is not None and step > 0:
            changed = changes(previous, entry)
            if changed:
                logging.warning("code changed since this run's last start at step %s (resuming "
                                "at step %d): %s; the steps from here are not what the earlier "
                                "code would compute", previous.get("step"), step,
                                ", ".join(changed))
        if old_text and not old_text.endswith("\n"):
            old_text += "\n"
        run_config.write_text_atomic(workdir, HISTORY_NAME, old_text + json.dumps(entry) + "\n")
    except Exception as e:  # noqa: BLE001  (a record of the run, never a reason to stop it)
        logging.warning("Could not record the code of this start in %s/%s (%s: %s); training "
                        "goes on.", workdir, HISTORY_NAME, type(e).__name__, e)

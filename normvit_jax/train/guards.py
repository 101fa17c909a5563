"""What keeps a run's state and summaries safe across faults; used by the loop.

- ``MetricsWindow``: the train metrics merged since the last log step, saved with each checkpoint
  (``checkpoint_meta``) so a run resumed between two log steps writes the summaries an
  uninterrupted one writes.
- ``check_finite`` / ``all_finite``: NaN/Inf in the loss, the gradient norm or the state stop the
  run before anything bad is saved, naming the first bad step and the last good checkpoint.
- ``CheckpointSaver``: async saves whose failures (disk full, permissions) become a WorkdirError
  naming the failed step and the newest complete checkpoint, which is kept.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from normvit_jax import checkpoints
from normvit_jax import workdir as workdir_lib
from normvit_jax.train.state import TrainState

META_FORMAT = 1  # version of the JSON saved beside each checkpoint's state


def checkpoint_meta(window: "MetricsWindow", skipped_total: int, mesh: Any = None) -> dict:
    """The JSON saved beside a checkpoint's state; with ``mesh``, also the mesh it trained on
    (``mesh_meta``; a resume on another one says so: ``mesh_change_note``)."""
    meta = {"format": META_FORMAT, "window": window.to_json(),
            "skipped_nonfinite_total": skipped_total}
    if mesh is not None:
        meta["mesh"] = mesh_meta(mesh)
    return meta


def mesh_meta(mesh: Any, processes: int | None = None) -> dict:
    """Devices, processes and the mesh's (data, fsdp) sizes (``processes``: default
    ``jax.process_count()``)."""
    return {"devices": int(mesh.devices.size),
            "processes": int(jax.process_count() if processes is None else processes),
            "data": int(mesh.shape.get("data", 1)), "fsdp": int(mesh.shape.get("fsdp", 1))}


def mesh_change_note(meta: dict | None, mesh: Any, processes: int | None = None) -> str | None:
    """One line when the checkpoint's meta records another mesh, device or process count than
    ``mesh`` (the all-reduce then adds the devices' gradients in another order: not bitwise);
    None when they are the same or the checkpoint (an older one) recorded none."""
    saved = (meta or {}).get("mesh")
    if not isinstance(saved, dict):
        return None
    now = mesh_meta(mesh, processes)
    keys = ("devices", "processes", "data", "fsdp")
    try:
        if all(int(saved[k]) == now[k] for k in keys):
            return None
    except (KeyError, TypeError, ValueError):  # a record this version does not read
        return None

    def procs(m: dict) -> str:
        n = int(m["processes"])
        return f" in {n} process{'es' if n != 1 else ''}" if show_processes else ""

    show_processes = int(saved["processes"]) > 1 or now["processes"] > 1
    return (f"The run trained on {int(saved['devices'])} devices{procs(saved)} (mesh "
            f"data={int(saved['data'])} x fsdp={int(saved['fsdp'])}) and continues on "
            f"{now['devices']}{procs(now)} (data={now['data']} x fsdp={now['fsdp']}): the same "
            "run, equal up to float32 rounding rather than bit for bit.")


class MetricsWindow:
    """Train metrics merged since the last log step (``start``), plus each step's own metrics
    since the last finiteness check (to name the first bad step). Saved in a checkpoint's meta so
    a run resumed between two log steps writes the same summaries as one never interrupted."""

    def __init__(self, start: int, acc: Any = None):
        self.start, self.acc = start, acc
        self.unchecked: list[tuple[int, Any]] = []

    def add(self, step: int, m: Any) -> None:
        self.acc = m if self.acc is None else self.acc.merge(m)
        self.unchecked.append((step, m))

    def values(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.acc.compute().items()}

    def first_nonfinite(self) -> tuple[int, list[str]] | None:
        for step, m in self.unchecked:
            bad = [k for k in ("loss", "grad_norm") if not math.isfinite(float(getattr(m, k).total))]
            if bad:
                return step, bad
        return None

    def to_json(self) -> dict | None:
        """Leaves as float.hex strings: exact, and NaN/Inf survive JSON."""
        if self.acc is None:
            return None
        leaves = [np.asarray(x) for x in jax.tree.leaves(self.acc)]
        return {"start": self.start,
                "leaves": [[str(x.dtype), float(x).hex()] for x in leaves]}

    @classmethod
    def from_meta(cls, meta: dict | None, step: int, metrics_like: Callable[[], Any]
                  ) -> tuple["MetricsWindow", int]:
        """The window and the skipped-steps total saved with the checkpoint of ``step``.
        ``metrics_like()``: a tree of the metrics class the run's train step returns (e.g.
        ``setup.train_metrics_shapes``); called only when a window was saved."""
        if not meta or meta.get("format") != META_FORMAT:
            return cls(step), 0
        skipped = int(meta.get("skipped_nonfinite_total", 0))
        w = meta.get("window")
        if not w:
            return cls(step), skipped
        treedef = jax.tree.structure(metrics_like())
        if treedef.num_leaves != len(w["leaves"]):  # the metrics changed since: restart the window
            logging.warning("The saved train-metrics window does not fit; starting a new one.")
            return cls(step), skipped
        leaves = [np.asarray(float.fromhex(v), dtype=d) for d, v in w["leaves"]]
        return cls(int(w["start"]), jax.tree.unflatten(treedef, leaves)), skipped


class CheckpointSaver:
    """Async Orbax saves whose failures (disk full, permissions, a lost bucket) become a
    WorkdirError naming the step that failed and the newest complete checkpoint, which is kept."""

    def __init__(self, mngr, workdir: str, rerun: str = "rerun the same command"):
        self.mngr, self.workdir = mngr, workdir
        self.rerun = rerun  # how to continue from the kept checkpoint (workdir.rerun_advice)
        self.pending: int | None = None   # step of the save in flight
        self.last_good: int | None = None  # newest step known to be committed (or in flight, checked)

    def describe(self) -> str:
        step = self.pending if self.pending is not None else self.last_good  # in flight: checked
        return "none" if step is None else f"step {step} in {self.mngr.directory}"

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.wait()
        try:
            checkpoints.save(self.mngr, step, state, meta=meta, force=True)
        except Exception as e:  # noqa: BLE001
            self._fail(step, e)
        self.pending = step

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._fail(self.pending, e)
        if self.pending is not None:
            self.last_good, self.pending = self.pending, None

    def _fail(self, step: int | None, e: BaseException) -> None:
        self.pending = None
        done = [s for s in checkpoints.complete_steps(self.workdir) if s != step]
        newest = f"step {done[-1]}" if done else "none"
        raise workdir_lib.WorkdirError(
            f"writing the checkpoint of step {step} to {self.mngr.directory} failed "
            f"({checkpoints.describe_error(e)}); the newest complete checkpoint ({newest}) is kept. Free "
            f"disk space or fix the workdir, then {self.rerun} to continue from it."
        ) from e

    def close(self, quiet: bool = False) -> None:
        """Waits for the save in flight; ``quiet``: log its failure instead of raising it."""
        try:
            self.wait()
        except workdir_lib.WorkdirError as e:
            if not quiet:
                raise
            logging.error("%s", e)
        finally:
            self.mngr.close()


@jax.jit
def all_finite(state: TrainState) -> jax.Array:
    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state, state.batch_stats))
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def check_finite(config: Any, window: MetricsWindow, state: Any, step: int, saver: CheckpointSaver
                  ) -> tuple[dict[str, float], int, str | None]:
    """The window's values, its number of skipped steps, and what is wrong if the run must stop:
    a NaN/Inf loss or grad norm, or with skip_nonfinite_steps=N, N skipped steps in a row."""
    values = window.values()
    skipped = int(round(values.get("skipped_nonfinite", 0.0) * float(window.acc.loss.count)))
    limit = config.skip_nonfinite_steps
    first = window.first_nonfinite()
    window.unchecked = []
    if limit == 0 and first is not None:
        bad_step, bad = first
        found = f" (found at step {step})" if step != bad_step else ""
        return values, skipped, (
            f"non-finite {' and '.join(bad)} at step {bad_step}{found}; nothing after it was "
            f"saved; last good checkpoint: {saver.describe()}. Lower the learning rate, enable "
            "grad clipping, or set config.skip_nonfinite_steps.")
    streak = int(state.nonfinite_streak)
    if limit and streak >= limit:
        return values, skipped, (
            f"{streak} updates in a row had a non-finite loss or grad_norm and were skipped "
            f"(steps {step - streak + 1} to {step}; config.skip_nonfinite_steps={limit}); last good "
            f"checkpoint: {saver.describe()}.")
    return values, skipped, None

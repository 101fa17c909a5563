"""Orbax checkpoints of the train state under ``workdir/checkpoints``.

Saves are asynchronous; Orbax writes each step into a temporary folder and renames it only when
complete, so a half-written checkpoint is never listed as a step. Restoring tries the newest
step first and falls back to older ones if a checkpoint's files are damaged.
"""
from __future__ import annotations

import json
import os
import logging
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)


def checkpoint_dir(workdir: str) -> epath.Path:
    workdir = str(workdir)
    if "://" not in workdir:  # Orbax wants absolute local paths
        workdir = os.path.abspath(workdir)
    return epath.Path(workdir) / "checkpoints"


def make_manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict | None = None,
         force: bool = False) -> bool:
    args = {"state": ocp.args.StandardSave(state)}
    if meta is not None:
        args["meta"] = ocp.args.JsonSave(meta)
    return mngr.save(step, args=ocp.args.Composite(**args), force=force)


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int) -> Any:
    """Restores ``step`` into the shapes, dtypes and shardings of ``abstract_state``."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return out["state"]


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any) -> tuple[Any, int | None]:
    """Newest checkpoint that restores, else (None, None). Damaged ones are skipped with a warning;
    a checkpoint whose structure differs from the model's raises (a config mismatch, not damage)."""
    steps = sorted(mngr.all_steps(), reverse=True)
    errors = []
    for step in steps:
        try:
            return restore(mngr, abstract_state, step), step
        except (ValueError, KeyError) as e:  # structure/shape mismatch: stop, never guess
            raise CheckpointMismatchError(
                f"checkpoint at step {step} in {checkpoint_dir_of(mngr)} does not match the model "
                f"built from the config: {_short(e)}") from e
        except Exception as e:  # damaged files: try an older step
            log.warning("Checkpoint at step %d is unreadable (%s); trying an older one.", step, _short(e))
            errors.append((step, e))
    if errors:
        raise CheckpointMismatchError(
            "no checkpoint in %s restores: %s" % (checkpoint_dir_of(mngr),
                                                  "; ".join(f"step {s}: {_short(e)}" for s, e in errors)))
    return None, None


class CheckpointMismatchError(RuntimeError):
    """A checkpoint exists but cannot be used for this config."""


def checkpoint_dir_of(mngr: ocp.CheckpointManager) -> str:
    return str(mngr.directory)


def _short(e: BaseException, n: int = 400) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= n else s[:n] + "..."


def _load_state(workdir: str, step: int | None) -> tuple[dict, ml_collections.ConfigDict]:
    config = load_config(workdir)
    mngr = ocp.CheckpointManager(checkpoint_dir(workdir))
    step = mngr.latest_step() if step is None else step
    mngr.close()
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {checkpoint_dir(workdir)}")
    ckpt = checkpoint_dir(workdir) / str(step) / "state"
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(ckpt)
    tree = getattr(meta, "item_metadata", meta)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree,
                            is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
    state = checkpointer.restore(ckpt, abstract)
    return jax.tree.map(np.asarray, state), config


def load_params(workdir: str, step: int | None = None) -> tuple[dict, ml_collections.ConfigDict]:
    """The params (numpy pytree) and config of a run's checkpoint, without building the model.

    For analysis and export. ``step`` None takes the newest checkpoint.
    """
    state, config = _load_state(workdir, step)
    return state["params"], config


def load_variables(workdir: str, step: int | None = None) -> tuple[dict, ml_collections.ConfigDict]:
    """``{'params': ..., 'batch_stats': ...}`` (batch_stats only if the model has state)."""
    state, config = _load_state(workdir, step)
    variables = {"params": state["params"]}
    if state.get("batch_stats"):
        variables["batch_stats"] = state["batch_stats"]
    return variables, config


def config_path(workdir: str) -> epath.Path:
    return epath.Path(workdir) / "config.json"


def load_config(workdir: str) -> ml_collections.ConfigDict:
    path = config_path(workdir)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir} a normvit_jax workdir?")
    return ml_collections.ConfigDict(json.loads(path.read_text()))

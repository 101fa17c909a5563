"""Orbax checkpoints of the train state under ``workdir/checkpoints``.

Saves are asynchronous. Orbax writes each step into a temporary folder and renames it only when
complete (on gs://, where a rename is a copy, into its final folder with a ``commit_success.txt``
written last), so a half-written checkpoint is never listed as a step (``complete_steps`` follows
Orbax's rule); the training's manager deletes such leftovers when it is created.

Every reader restores through ``first_restorable``, newest step first: a checkpoint whose files are
damaged is skipped with one warning line naming its step and the file (training also moves it to
``workdir/damaged_checkpoints/``) and an older one is used; a checkpoint whose tree or shapes
differ from the model is a config mismatch and stops. Training, evaluation and recalibrate restore
into the model's train state (``restore_latest``); predict, reparam, export and the analysis tools
into the saved tree as numpy arrays (``restore_numpy``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from normvit_jax import run_config
from normvit_jax import workdir as workdir_lib

log = logging.getLogger(__name__)
DAMAGED_DIR = "damaged_checkpoints"


class CheckpointMismatchError(RuntimeError):
    """A checkpoint exists but cannot be used for this config, or none restores."""


class RunNotFoundError(FileNotFoundError):
    """The workdir, its config.json or its checkpoint is missing; the message names what and the
    command that makes it (the post-training tools print it as one line, exit 2)."""


def require_run(workdir: str) -> None:
    """Raises RunNotFoundError unless ``workdir`` holds a run's config.json."""
    problem = workdir_lib.not_a_folder(workdir)
    if problem:  # not "holds no run" / "does not exist: train one there"
        raise RunNotFoundError(f"{workdir} {problem}: pass the workdir of a run (the folder "
                               "holding its config.json and checkpoints)")
    if not epath.Path(workdir).exists():
        raise RunNotFoundError(
            f"{workdir} does not exist: train a run there first, e.g. python main.py "
            f"--config=configs/vit_ln.py:demo --workdir={workdir}")
    if not config_path(workdir).exists() and (epath.Path(workdir) / "model.json").exists():
        # reparam's/export's folded model: "train one there" would have sent the user to
        # train into it
        raise RunNotFoundError(
            f"{workdir} holds a folded model (model.json, python -m normvit_jax.reparam), not a "
            f"run: pass the workdir it was folded from (predict takes the folder as --folded)")
    if not config_path(workdir).exists() and run_config.has_checkpoint(workdir):
        raise RunNotFoundError(run_config.missing_config(workdir))
    if not config_path(workdir).exists():
        raise RunNotFoundError(
            f"{workdir} holds no run (no config.json): train one there first, e.g. python main.py "
            f"--config=configs/vit_ln.py:demo --workdir={workdir}")


def check_checkpoint_dir(workdir: str) -> None:
    """WorkdirLayoutError (exit 2) naming ``workdir/checkpoints`` when it is a file or a symbolic
    link that leads nowhere (a loop): Orbax's NotADirectoryError / FileExistsError otherwise."""
    d = checkpoint_dir(workdir)
    problem = workdir_lib.not_a_folder(d)
    if problem:
        raise workdir_lib.WorkdirLayoutError(
            f"{d} {problem}: a run keeps its checkpoints in that folder; move it away (or put "
            f"the run's checkpoint folder back there) and rerun; nothing was changed")


def recorded_step(workdir: str) -> int | None:
    """The furthest step the run's own records reach: its summaries and code.jsonl (the step each
    start began at); None when they hold none."""
    from normvit_jax import run_code, summaries  # pylint: disable=import-outside-toplevel
    steps = []
    try:
        steps.append(summaries.last_step(workdir))
    except Exception:  # noqa: BLE001  (an unreadable event file is no evidence)
        pass
    try:
        for line in (epath.Path(workdir) / run_code.HISTORY_NAME).read_text().splitlines():
            steps.append(int(json.loads(line).get("step", 0)))
    except Exception:  # noqa: BLE001
        pass
    steps = [s for s in steps if s is not None]
    return max(steps) if steps else None


def checkpoints_gone(workdir: str, checkpoint_every: int | None = None) -> str | None:
    """For a workdir without a checkpoint: the first half of a line saying that its checkpoints
    are gone when its records reach a checkpoint step (config.checkpoint_every, from config.json
    unless given), else None (a run that ended before its first checkpoint)."""
    if checkpoint_every is None:
        try:
            checkpoint_every = int(run_config.read_saved(config_path(workdir))["checkpoint_every"])
        except Exception:  # noqa: BLE001
            return None
    reached = recorded_step(workdir)
    # Two intervals, not one: a run killed while its first save was written has records up to
    # (with the asynchronous save, past) that step and no checkpoint, and its re-run starts at 0
    # as documented; a save waits for the one before, so records at 2 x checkpoint_every mean the
    # first save completed and has since gone.
    if reached is None or reached < 2 * max(int(checkpoint_every), 1):
        return None
    return (f"no checkpoint in {checkpoint_dir(workdir)}, but the run's records (its summaries, "
            f"code.jsonl) reach step {reached}: its checkpoints are gone (moved or deleted)")


def no_checkpoint(workdir: str, step: int | None = None, steps: list[int] | None = None
                  ) -> RunNotFoundError:
    """The error for a run without (that) checkpoint."""
    if step is not None and steps:
        return RunNotFoundError(f"no checkpoint of step {step} in {checkpoint_dir(workdir)}; there "
                                f"are: {steps} (leave the step out for the newest)")
    gone = checkpoints_gone(workdir) if step is None else None
    if gone:
        return RunNotFoundError(f"{gone}; put them back into {checkpoint_dir(workdir)} to use "
                                "the run")
    return RunNotFoundError(
        f"no checkpoint in {checkpoint_dir(workdir)}: the run has not saved one yet; continue it "
        f"with the command that started it (same --workdir; its config is "
        f"{config_path(workdir)}) until it passes config.checkpoint_every steps or ends")


def checkpoint_dir(workdir: str) -> epath.Path:
    workdir = str(workdir)
    if "://" not in workdir:  # Orbax wants absolute local paths
        workdir = os.path.abspath(workdir)
    return epath.Path(workdir) / "checkpoints"


def make_manager(workdir: str, keep: int = 3, async_save: bool = True) -> ocp.CheckpointManager:
    """Training's manager. It deletes the half-written saves a killed run left (one line names
    them) and ignores folders that are not step names (one warning names them)."""
    check_checkpoint_dir(workdir)
    _note_strays(checkpoint_dir(workdir))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_handlers=handlers)


def _note_strays(d: epath.Path) -> None:
    if "://" in str(d) or not os.path.isdir(d):
        return
    names = sorted(os.listdir(d))
    tmp = [n for n in names if ".orbax-checkpoint-tmp" in n]
    if tmp:
        log.warning("Deleting the half-written checkpoint folder%s %s (a save that was cut short: "
                    "never a complete step).", "s" if len(tmp) > 1 else "",
                    ", ".join(str(d / n) for n in tmp))
    other = [n for n in names if n not in tmp and not run_config.is_step_name(n)]
    if other:
        log.warning("%s holds %s, which %s not step folders (a step's folder is named by its "
                    "number, as Orbax writes it: '60', not '0060'): ignored by training and by "
                    "every tool.", d, ", ".join(other), "is" if len(other) == 1 else "are")


def open_read_only(workdir: str) -> ocp.CheckpointManager:
    """A manager that never writes, deletes or cleans up: safe beside a run still training."""
    options = ocp.CheckpointManagerOptions(create=False, read_only=True)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_handlers=handlers)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict | None = None,
         force: bool = False) -> bool:
    """Starts an (async) save; ``meta`` is a small JSON dict saved beside the state."""
    args = {"state": ocp.args.StandardSave(state)}
    if meta is not None:
        args["meta"] = ocp.args.JsonSave(meta)
    return mngr.save(step, args=ocp.args.Composite(**args), force=force)


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int) -> Any:
    """Restores ``step`` into the shapes, dtypes and shardings of ``abstract_state``."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return out["state"]


@dataclasses.dataclass
class Restored:
    state: Any
    step: int
    meta: dict | None                       # what ``save`` got as ``meta`` (None for old runs)
    damaged: list[tuple[int, str, str]]     # (step, error, where it was moved or '') of skipped ones


class _Damaged(Exception):
    """A checkpoint's files cannot be read (the message names the file where it can)."""


def restore_latest(mngr: ocp.CheckpointManager, abstract_state: Any, move_damaged: bool = True,
                   steps: list[int] | None = None, others: list[int] | None = None
                   ) -> Restored | None:
    """The newest checkpoint (of ``steps``, default all) that restores, or None if there is none.

    A damaged newer checkpoint is skipped with one warning naming its step, the file that failed
    and the step used instead; with ``move_damaged`` (training) it is moved out of the way once an
    older one has restored (Orbax would otherwise keep it as the latest step and refuse to save
    that step again); evaluation leaves it in place. Raises CheckpointMismatchError if a
    checkpoint's tree, shapes or dtypes differ from ``abstract_state`` (a config change, not
    damage), or if checkpoints exist and none restores (then nothing is moved).
    """
    def one(step: int) -> tuple[Any, dict | None]:
        problem = mismatch(mngr, step, abstract_state)
        if problem is not None and problem[0] == "mismatch":
            raise CheckpointMismatchError(
                f"the checkpoint at step {step} in {mngr.directory} does not match the model built "
                f"from the config: {problem[1]}. " + (
                    "The config in this workdir was changed in a way that changes the model; use "
                    "another --workdir, or --fresh to start over." if move_damaged else
                    "Evaluate with the config the run was trained with (its config.json)."))
        if problem is not None:
            raise _Damaged(problem[1])
        return restore(mngr, abstract_state, step), _restore_meta(mngr, step)

    return first_restorable(mngr, steps, one, move_damaged, others)


def first_restorable(mngr: ocp.CheckpointManager, steps: list[int] | None,
                     restore_one: Any, move_damaged: bool = False,
                     others: list[int] | None = None) -> Restored | None:
    """The one restore path of training, evaluation and every tool: ``restore_one(step) ->
    (state, meta)`` on each step newest first; a step that raises anything but
    CheckpointMismatchError is damaged: skipped with one warning (step, file, the step used
    instead), and moved aside with ``move_damaged``. None if there are no steps;
    CheckpointMismatchError naming every step if none restores (and ``others``, the steps a
    ``--step`` left out, with how to use them)."""
    steps = sorted(mngr.all_steps() if steps is None else steps, reverse=True)
    failed: list[tuple[int, str]] = []
    for step in steps:
        try:
            state, meta = restore_one(step)
        except CheckpointMismatchError:
            raise
        except Exception as e:  # noqa: BLE001  (tensorstore, JSON, OS errors: damage)
            failed.append((step, str(e) if isinstance(e, _Damaged)
                           else describe_damage(e, step_dir(mngr, step))))
            continue
        moved = _quarantine_all(mngr, failed) if move_damaged else [(s, e, "") for s, e in failed]
        for s, err, dest in moved:
            log.warning("Checkpoint at step %d in %s is damaged (%s)%s; using step %d instead.",
                        s, mngr.directory, err, f"; moved to {dest}" if dest else "", step)
        if moved and move_damaged:
            mngr.reload()
        return Restored(state, step, meta, moved)
    if failed:
        raise CheckpointMismatchError(
            f"no checkpoint in {mngr.directory} restores: "
            + "; ".join(f"step {s}: {e}" for s, e in failed) + ". Nothing was moved or deleted."
            + (" Re-run with --fresh to start from step 0 (the old run is moved to replaced/)."
               if move_damaged else "") + _other_steps(others))
    return None


def _other_steps(others: list[int] | None) -> str:
    others = sorted(others or [])
    if not others:
        return ""
    return (f" The other step{'s' if len(others) > 1 else ''} "
            f"{', '.join(map(str, others))} exist{'' if len(others) > 1 else 's'}: leave out "
            "--step to use the newest one that restores.")


def _quarantine_all(mngr: ocp.CheckpointManager, failed: list[tuple[int, str]]
                    ) -> list[tuple[int, str, str]]:
    """``quarantine`` of each failed step by process 0 only, then every process waits for it
    (``distributed.agree``: the barrier before ``mngr.reload``, and a failed move stops every
    process with its reason). Every process used to move the folder: the first rename won and
    the others raised FileNotFoundError (a traceback) while the winner waited in a collective."""
    from normvit_jax import distributed
    moved, error = [], None
    try:
        for s, err in failed:
            where = (quarantine(mngr, s) if jax.process_index() == 0 else
                     f"{epath.Path(mngr.directory).parent / DAMAGED_DIR} (by process 0)")
            moved.append((s, err, where))
    except Exception as e:  # noqa: BLE001  (re-raised by agree on every process)
        error = e
    distributed.agree("moving the damaged checkpoints aside", error)
    return moved


def describe_damage(e: BaseException, step_path: epath.Path) -> str:
    """``describe_error`` with the file that failed: a truncated JSON metadata file raises a bare
    JSONDecodeError that names no file, so the step's JSON files are checked to name it; a missing
    part of the step is named alone (``_missing_part``)."""
    missing = _missing_part(step_path)
    if missing:
        return missing
    text = describe_error(e)
    if str(step_path) in text:
        return text
    bad = _unreadable_json(step_path)
    return f"{bad}: {text}" if bad else text


def _missing_part(step_path: epath.Path) -> str | None:
    """'6/ is empty', '6/state/ is missing', '6/state/manifest.ocdbt is missing' for a step folder
    that lacks what every checkpoint has; Orbax's own error named something else ("Unknown key:
    state. Available keys: dict_keys([])", 'Metadata at "<leaf>/.zarray" ... does not exist').
    None when they are there (or on gs://)."""
    root = str(step_path)
    if "://" in root or not os.path.isdir(root):
        return None
    name = os.path.basename(root.rstrip("/"))
    if not os.listdir(root):
        return f"{name}/ is empty"
    state = os.path.join(root, "state")
    if not os.path.isdir(state):
        return f"{name}/state/ is missing"
    if not os.path.exists(os.path.join(state, "manifest.ocdbt")):
        return f"{name}/state/manifest.ocdbt is missing"
    return None


def _unreadable_json(step_path: epath.Path) -> str | None:
    """The first of a checkpoint's JSON metadata files (all but the OCDBT data, its manifests and
    the commit markers) that does not parse; None if they all do."""
    root = str(step_path)
    if "://" in root or not os.path.isdir(root):
        return None
    for folder, dirs, files in os.walk(root):  # not sorted(os.walk()): that walks before pruning
        dirs[:] = sorted(d for d in dirs if d != "d")
        for name in sorted(files):
            if name.endswith((".ocdbt", ".txt")):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    json.loads(f.read())
            except (OSError, ValueError):
                return path
    return None


def mismatch(mngr: ocp.CheckpointManager, step: int, abstract_state: Any
             ) -> tuple[str, str] | None:
    """None if the saved tree at ``step`` has the paths, shapes and dtypes of ``abstract_state``;
    ('damaged', why) if its metadata cannot be read; ('mismatch', what differs) otherwise."""
    try:
        meta = mngr.item_metadata(step)["state"]
        if meta is None:  # Orbax's answer when state/_METADATA is gone: name the file
            path = step_dir(mngr, step) / "state" / "_METADATA"
            raise (ValueError("no metadata for the item 'state'") if path.exists() else
                   FileNotFoundError(f"Metadata file {path} does not exist"))
        saved = _leaf_specs(getattr(meta, "item_metadata", meta))
    except Exception as e:  # noqa: BLE001
        missing = _missing_part(step_dir(mngr, step))
        return "damaged", missing or \
            f"its metadata cannot be read: {describe_damage(e, step_dir(mngr, step))}"
    wanted = _leaf_specs(abstract_state)
    diffs = []  # the params first: the optimizer state only repeats them
    for path in sorted(set(saved) | set(wanted), key=lambda p: (not p.startswith("params/"), p)):
        a, b = saved.get(path), wanted.get(path)
        if a is None:
            diffs.append(f"{path} missing in the checkpoint (model: {b[0]} {b[1]})")
        elif b is None:
            diffs.append(f"{path} {a[0]} {a[1]} in the checkpoint, not in the model")
        elif a != b:
            diffs.append(f"{path}: {a[0]} {a[1]} in the checkpoint, {b[0]} {b[1]} in the model")
    if not diffs:
        return None
    more = f" (and {len(diffs) - 5} more arrays)" if len(diffs) > 5 else ""
    return "mismatch", _ema_hint(saved, wanted) + "; ".join(diffs[:5]) + more


def _ema_hint(saved: dict, wanted: dict) -> str:
    """The weight EMA lives in the optimizer state (train/ema.py): turning ``config.ema_decay`` on
    or off changes every optimizer path, so say that first."""
    has = lambda specs: any("/ema_params/" in p for p in specs)  # noqa: E731
    stats = lambda specs: any("/ema_batch_stats/" in p for p in specs)  # noqa: E731
    if has(wanted) and has(saved) and stats(wanted) != stats(saved):
        return ("the checkpoint %s an EMA of the norm statistics but config.ema_batch_stats is %s "
                "(set it to that run's value to continue it); "
                % (("keeps", False) if stats(saved) else ("keeps no", True)))
    if has(wanted) and not has(saved):
        return ("the checkpoint keeps no EMA of the weights but config.ema_decay > 0 asks for one "
                "(set ema_decay to its value in that run, 0, to continue it); ")
    if has(saved) and not has(wanted):
        return ("the checkpoint keeps an EMA of the weights but config.ema_decay is 0 (set it to "
                "that run's value to continue it); ")
    return ""


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """'params/embedding/kernel' -> (shape, dtype), for any container (dicts, dataclasses, lists)."""
    is_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        out[jax.tree_util.keystr(path, simple=True, separator="/")] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return out


def step_dir(mngr: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(mngr.directory) / str(step)


def _restore_meta(mngr: ocp.CheckpointManager, step: int) -> dict | None:
    if not (step_dir(mngr, step) / "meta").exists():
        return None
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def quarantine(mngr: ocp.CheckpointManager, step: int) -> str:
    """Moves a damaged step folder to ``workdir/damaged_checkpoints/<step>`` (kept for a look),
    with ``--mode=eval``'s results of that step: training re-runs the step and saves it again,
    and an ``eval_*_<step>.json`` left behind would read as the new checkpoint's metrics.
    Returns where it went (and which results went with it), for the warning line."""
    src = step_dir(mngr, step)
    workdir = epath.Path(mngr.directory).parent
    dest_root = workdir / DAMAGED_DIR
    problem = workdir_lib.not_a_folder(dest_root)
    if problem:  # FileExistsError from mkdir otherwise
        raise workdir_lib.WorkdirLayoutError(
            f"the damaged checkpoint of step {step} cannot be moved aside: {dest_root} {problem}; "
            "move it away and rerun the same command (nothing was moved)")
    dest_root.mkdir(parents=True, exist_ok=True)
    dest = dest_root / str(step)
    n = 1
    while dest.exists():
        dest, n = dest_root / f"{step}.{n}", n + 1
    src.rename(dest)
    results = eval_results(workdir, step)
    for p in results:
        p.rename(dest / p.name)
    return str(dest) + (f" with its eval results {', '.join(p.name for p in results)}"
                        if results else "")


def eval_results(workdir: Any, step: int) -> list[epath.Path]:
    """``--mode=eval``'s result files of ``step`` in ``workdir`` (evaluation.result_path:
    ``eval_<dataset>_<split>_<step>.json``, and its confusion-matrix pictures
    ``eval_<dataset>_<split>_confusion_<step>.png``)."""
    root = epath.Path(workdir)  # not step 16's: '_6.json'
    return sorted([*root.glob(f"eval_*_{step}.json"), *root.glob(f"eval_*_{step}.png")])


def complete_steps(workdir: str) -> list[int]:
    """Steps whose checkpoint Orbax committed, by Orbax's own rule: a local one was renamed from
    its temporary folder; one on gs:// is written in place, under its final name, and committed
    by its ``commit_success.txt`` (a step folder without it is still being written, or was left
    by a killed run, and the training's manager does not list it either)."""
    check_checkpoint_dir(workdir)
    d = checkpoint_dir(workdir)
    if not d.exists():
        return []
    return sorted(int(p.name) for p in d.iterdir()  # '0060' is no step: Orbax does not list it
                  if run_config.is_step_name(p.name) and ocp.step.is_checkpoint_finalized(p))


def describe_error(e: BaseException, n: int = 500) -> str:
    """The innermost cause (TensorStore's wrapper hides which file failed), on one line, without
    TensorStore's source locations and spec dump; when long, its head (what) and tail (why, e.g.
    'File too large [os_error_code=27]')."""
    while e.__cause__ is not None:
        e = e.__cause__
    s = " ".join(f"{type(e).__name__}: {e}".split())
    s = re.split(r" \[(?:source locations|tensorstore_spec)=", s)[0]  # TensorStore's debug tail
    return s if len(s) <= n else s[:n // 2] + " ... " + s[-(n // 2):]


def load_state(workdir: str, step: int | None = None) -> tuple[dict, ml_collections.ConfigDict]:
    """The whole train state of a checkpoint (params, opt_state, batch_stats, rng, step, ...) as
    numpy arrays, and the run's config, without building the model. ``step`` None: the newest
    that restores (``restore_numpy``)."""
    restored, config = restore_numpy(workdir, step)
    return restored.state, config


def restore_numpy(workdir: str, step: int | None = None
                  ) -> tuple[Restored, ml_collections.ConfigDict]:
    """(the checkpoint restored as numpy arrays, the run's config) for the tools that read a run
    without building its train state (predict, reparam, export, analysis). Read-only, through
    ``first_restorable`` as training and evaluation: with ``step`` None a damaged newest
    checkpoint is named in one warning and the previous one is used; RunNotFoundError when there
    is no checkpoint (of ``step``), CheckpointMismatchError when none restores."""
    config = load_config(workdir)
    steps = complete_steps(workdir)
    if not steps or (step is not None and step not in steps):
        raise no_checkpoint(workdir, step, steps)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    is_leaf = lambda m: hasattr(m, "shape") and hasattr(m, "dtype")  # noqa: E731
    mngr = open_read_only(workdir)

    def one(s: int) -> tuple[Any, None]:
        try:
            meta = mngr.item_metadata(s)["state"]
            tree = getattr(meta, "item_metadata", meta)
        except Exception as e:  # noqa: BLE001
            raise _Damaged(f"its metadata cannot be read: {describe_damage(e, step_dir(mngr, s))}")
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                tree, is_leaf=is_leaf)
        return jax.tree.map(np.asarray, restore(mngr, abstract, s)), None

    try:
        restored = first_restorable(mngr, steps if step is None else [step], one,
                                    others=None if step is None else
                                    [s for s in steps if s != step])
    finally:
        mngr.close()
    return restored, config


def load_params(workdir: str, step: int | None = None) -> tuple[dict, ml_collections.ConfigDict]:
    """The params (numpy pytree) and config of a run's checkpoint, without building the model.

    For analysis and export. ``step`` None takes the newest checkpoint.
    """
    state, config = load_state(workdir, step)
    return state["params"], config


def load_variables(workdir: str, step: int | None = None) -> tuple[dict, ml_collections.ConfigDict]:
    """``{'params': ..., 'batch_stats': ...}`` (batch_stats only if the model has state)."""
    state, config = load_state(workdir, step)
    return variables_of(state), config


def variables_of(state: dict) -> dict:
    """The model's variables of a restored numpy state: params, and batch_stats if it has any."""
    variables = {"params": state["params"]}
    if state.get("batch_stats"):
        variables["batch_stats"] = state["batch_stats"]
    return variables


class NoEmaError(ValueError):
    """``--weights=ema`` of a run that kept no EMA of its weights (one line, exit 2)."""


def ema_of(state: dict) -> dict | None:
    """The weight EMA (train/ema.py's ``EmaState``, restored as ``{'ema_params',
    'ema_batch_stats'}``) inside a restored numpy state's ``opt_state``; None without one."""
    def walk(tree: Any) -> dict | None:
        if isinstance(tree, dict):
            if "ema_params" in tree:
                return tree
            children = list(tree.values())
        elif isinstance(tree, (list, tuple)):
            children = list(tree)
        else:
            return None
        for child in children:
            found = walk(child)
            if found is not None:
                return found
        return None
    return walk(state.get("opt_state"))


def note_raw_weights(workdir: str) -> None:
    """The log line of a tool using the raw weights of a run that keeps an EMA (no --weights)."""
    log.warning("%s keeps an EMA of the weights (config.ema_decay > 0): using the raw weights; "
                "--weights=ema uses the EMA (its eval/ema_* metrics)", workdir)


def no_ema(workdir: str) -> NoEmaError:
    """The error of ``--weights=ema`` for a run without an EMA."""
    return NoEmaError(f"--weights=ema: the run {workdir} keeps no EMA of its weights "
                      "(config.ema_decay is 0); leave --weights out for its weights")


def choose_weights(state: dict, weights: str | None, workdir: str) -> tuple[dict, dict]:
    """(the model's variables, what they are) of a restored numpy state for ``--weights``
    (tool_flags.WEIGHTS): 'ema' the EMA params with the EMA norm statistics when the run averaged
    them (else its raw ones, as its eval/ema_* metrics), NoEmaError for a run without an EMA;
    'raw' or None the trained weights, None with one log line naming the flag when the run has an
    EMA (timm's default, and a DeiT-style run is often best on its EMA). The record,
    ``{'weights': 'raw'|'ema'}`` (+ ``'norm_statistics'`` for EMA weights of a model with running
    statistics), goes into what the tools write (reparam's model.json, an export's metadata)."""
    ema = ema_of(state)
    raw = variables_of(state)
    if weights not in (None, "raw", "ema"):
        raise ValueError(f"--weights={weights} is not accepted; accepted: raw, ema")
    if weights != "ema":
        if ema is not None and weights is None:
            note_raw_weights(workdir)
        return raw, {"weights": "raw"}
    if ema is None:
        raise no_ema(workdir)
    variables = {"params": ema["ema_params"]}
    record = {"weights": "ema"}
    if "batch_stats" in raw:
        averaged = bool(jax.tree.leaves(ema.get("ema_batch_stats")))
        variables["batch_stats"] = ema["ema_batch_stats"] if averaged else raw["batch_stats"]
        record["norm_statistics"] = "ema" if averaged else (
            "raw (the run did not average them: config.ema_batch_stats=False)")
    return variables, record


def restore_weights(workdir: str, step: int | None = None, weights: str | None = None
                    ) -> tuple[dict, ml_collections.ConfigDict, dict]:
    """(variables, config, record) for the tools' ``--step`` and ``--weights``: the shared
    restore (``restore_numpy``), then ``choose_weights``; the record adds the step restored."""
    restored, config = restore_numpy(workdir, step)
    variables, record = choose_weights(restored.state, weights, workdir)
    n = zero_head_classes(variables.get("params", {}))
    if n:  # an import whose head was re-initialised (train/importer.py): nothing to predict yet
        log.warning("%s step %d: the head is all zeros (an import whose head was re-initialised "
                    "for %d classes?): every image gets probability 1/%d; train the run first "
                    "(docs/pretrained.md).", workdir, int(restored.step), n, n)
    return variables, config, {**record, "step": int(restored.step)}


def zero_head_classes(params: Any) -> int | None:
    """The class count of a head whose kernel and bias are all zeros (every image gets the same,
    uniform probabilities: a head the loader re-initialised and no step trained), else None."""
    head = params.get("head") if hasattr(params, "get") else None
    if not head or "kernel" not in head or "bias" not in head:
        return None
    kernel, bias = np.asarray(head["kernel"]), np.asarray(head["bias"])
    return int(bias.shape[-1]) if not kernel.any() and not bias.any() else None


def config_path(workdir: str) -> epath.Path:
    return epath.Path(workdir) / "config.json"


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The run's config (its config.json); RunNotFoundError naming what is missing."""
    require_run(workdir)
    return ml_collections.ConfigDict(run_config.read_saved(config_path(workdir)))

"""A run's saved config: ``workdir/config.json``, the diff that refuses a changed re-run, and its
atomic write. No JAX here (``workdir.prepare`` checks the config before JAX starts).
"""
from __future__ import annotations

import datetime
import json
from typing import Any

from absl import logging
from etils import epath

CONFIG_NAME = "config.json"
REPLACED_DIR = "replaced"          # --fresh moves an old run here (workdir.move_run_aside)
# Keys that may differ between the saved config and a re-run without allow_config_change.
# log_every, eval_every, checkpoint_every and keep_checkpoints choose at which steps train
# metrics are written and checked, the model is evaluated (no state changes) and the state is
# saved and kept; the eval_*_images keys choose what an eval writes to TensorBoard: they change
# neither the trained numbers nor the resume's exactness. The mesh places the same state on
# devices (checkpoints restore onto any mesh): the same run, but with another mesh (or device
# count) equal up to float32 rounding, not bitwise (the all-reduce adds the devices' gradients in
# another order; train/build.py says so when a checkpoint's recorded mesh differs). A change of
# them is said in one info line and recorded in config.json (the old file kept as
# config.before-<time>.json).
ALWAYS_CHANGEABLE = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "eval_analysis_images", "eval_attention_images",
                     "mesh.data", "mesh.fsdp", "mesh.fsdp_min_size")
# Never compared, and saved as False: a permission for the invocation that passes it, not part of
# the run (a saved True let a later --config=W re-run change anything without the flag).
NOT_COMPARED = ("allow_config_change",)
# The inputs of the learning-rate schedule: a change of them on a resume recomputes it
# (train/build.py says how the rate at the resume step changes).
SCHEDULE_KEYS = ("total_steps", "num_epochs", "batch_size", "optimizer.learning_rate")
SCHEDULE_PREFIX = "schedule."


# A norm's options that choose how the same values are computed (LayerNorm's saved input, DTN's
# recompute, kernel and Pallas tiling: the backward's memory and speed): an eval may change them
# (evaluation.py) and the report pools runs that differ in them (analysis/recipes.py).
IMPLEMENTATION_NORM_OPTIONS = ("saved_input", "recompute", "kernel", "pallas_tiling")


def is_norm_implementation_key(key: str) -> bool:
    """'model.norm.kernel', 'model.norm_overrides.final.saved_input', ...: see above."""
    return (key.startswith(("model.norm.", "model.norm_overrides."))
            and key.rsplit(".", 1)[1] in IMPLEMENTATION_NORM_OPTIONS)


class ConfigChangedError(ValueError):
    """The workdir holds a run made with another config."""


def read_json(path: Any, advice: str, error: type[Exception] = ValueError) -> Any:
    """A JSON file this project wrote (config.json, classes.json, prepare.json, an artifact's
    metadata); one damaged after it was written, or that cannot be read (permissions, a folder),
    is an ``error`` naming it and saying what to do (``advice``), not JSON's bare 'Unterminated
    string ...' or an OSError's traceback. A missing file stays FileNotFoundError."""
    try:  # reading too: bytes that are not UTF-8 (UnicodeDecodeError) are damage as well
        return json.loads(epath.Path(path).read_text())
    except ValueError as e:
        raise error(f"{path} is not readable JSON ({e}); {advice}") from None
    except FileNotFoundError:  # callers that allow a missing file check for it themselves
        raise
    except OSError as e:  # permissions, a folder of that name: the same one line, not a traceback
        raise error(f"{path} cannot be read ({type(e).__name__}: {e.strerror or e}); make it "
                    f"readable, or {advice}") from None


def read_saved(path: Any) -> dict:
    """A run's config.json as a dict (written atomically: a damaged one was changed after)."""
    return read_json(path, "restore the file (a config.before-*.json beside it is an older "
                           "copy) or use another --workdir")


def utc_stamp() -> str:
    """The time as the names of kept files have it (config.before-<time>.json, replaced/<time>)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")



def flatten(d: dict, prefix: str = "") -> dict:
    """A nested dict (a config.json) by dotted key: {'data': {'name': 'x'}} -> {'data.name': 'x'}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flat_values(config: Any) -> dict:
    """A ConfigDict's values by dotted key ('data.image_size'), as its JSON has them."""
    return flatten(json.loads(config.to_json_best_effort()))


def default_values() -> dict:
    """Flattened values of configs/default.py: a key a newer version added is absent from an
    older run's config.json; at its default it keeps the old behaviour, so it is no change."""
    from configs import default  # pylint: disable=import-outside-toplevel
    return flat_values(default.get_config())


def changed_keys(saved: dict, current: dict, defaults: dict | None = None
                 ) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every key that differs, sorted by key, but
    ``NOT_COMPARED`` and a key absent from ``saved`` (a newer version added it) at its default;
    an absent value is ``'<absent>'``."""
    a, b = flatten(saved), flatten(current)
    defaults = default_values() if defaults is None else defaults

    def changed(k: str) -> bool:
        if k in NOT_COMPARED or a.get(k) == b.get(k):
            return False
        return not (k not in a and k in defaults and b.get(k) == defaults[k])

    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>"))
            for k in sorted(set(a) | set(b)) if changed(k)]


def _describe(changes: list[tuple[str, Any, Any]]) -> list[str]:
    return [f"{k}: {old!r} -> {new!r}" for k, old, new in changes]


def config_diff(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """``'key: old -> new'`` of every changed key that needs allow_config_change (all but
    ``ALWAYS_CHANGEABLE``)."""
    return _describe([c for c in changed_keys(saved, current, defaults)
                      if c[0] not in ALWAYS_CHANGEABLE])


def changeable_diff(saved: dict, current: dict, defaults: dict | None = None) -> list[str]:
    """``'key: old -> new'`` of every changed ``ALWAYS_CHANGEABLE`` key."""
    return _describe([c for c in changed_keys(saved, current, defaults)
                      if c[0] in ALWAYS_CHANGEABLE])


def is_schedule_key(key: str) -> bool:
    return key in SCHEDULE_KEYS or key.startswith(SCHEDULE_PREFIX)


def check_config(config: Any, workdir: str) -> None:
    """Refuses, in one line naming the changed keys, a workdir whose config.json differs from
    ``config`` in a key outside ``ALWAYS_CHANGEABLE``, and one with checkpoints but no config.json
    (``missing_config``), unless ``config.allow_config_change``."""
    path = epath.Path(workdir) / CONFIG_NAME
    if not path.exists():
        if has_checkpoint(workdir) and not config.get("allow_config_change"):
            raise ConfigChangedError(missing_config(workdir, training=True))
        return
    diff = config_diff(read_saved(path), json.loads(config.to_json_best_effort()))
    if diff and not has_checkpoint(workdir):
        # An earlier start failed before its first checkpoint (a wrong init_from, data not yet
        # prepared): nothing was trained with the old config, so the corrected command goes on;
        # write_config keeps the old file as config.before-<time>.json.
        logging.warning("%s has no checkpoint yet: taking the new config (changed keys: %s)",
                        workdir, ", ".join(diff))
        return
    if diff and not config.get("allow_config_change"):
        raise ConfigChangedError(
            f"{workdir} holds a run made with another config; changed keys: {', '.join(diff)}; "
            "use another --workdir, pass --config.allow_config_change=True to continue this run "
            "with the new values (this once: config.json records it False), or --fresh to start "
            f"over (the old run is moved to {REPLACED_DIR}/)")


def check_eval_dataset(config: Any, workdir: str) -> None:
    """``--mode=eval`` with a ``--config`` whose training dataset is not the run's: a
    ConfigChangedError naming the run's (and its data_dir) and the flags that select it. Without
    it, a run trained on a prepared dataset and evaluated with the config file alone stopped
    with "dataset 'cifar10' is not prepared", never naming the dataset the run trained on. The
    eval set is chosen with data.eval_name, which is not compared."""
    path = epath.Path(workdir) / CONFIG_NAME
    if not path.exists():  # no run there: the checkpoint checks say so
        return
    saved, current = flatten(read_saved(path)), flat_values(config)
    name, data_dir = saved.get("data.name"), saved.get("data.data_dir")
    if name is None or name == current.get("data.name"):
        return
    add = f"--config.data.name={name}" + (
        f" --config.data.data_dir={data_dir}"
        if data_dir and data_dir != current.get("data.data_dir") else "")
    raise ConfigChangedError(
        f"the run in {workdir} trained on dataset {name!r}"
        + (f" (data_dir {data_dir})" if data_dir else "")
        + f"; this config names {current.get('data.name')!r}: add {add}, or leave out --config "
          "(the run's own config.json is used); another eval set: --config.data.eval_name=NAME")


def missing_config(workdir: str, training: bool = False) -> str:
    """The one line for a workdir that holds checkpoints but no config.json (deleted, or lost in
    a copy): the config the run trained with is unknown, so neither a re-run nor a tool may take
    another one silently. ``training``: main.py's ways out, else the tools' (restore it, or
    continue the run with main.py to record one)."""
    before = sorted(p.name for p in epath.Path(workdir).glob("config.before-*.json"))
    restore = (f"restore {epath.Path(workdir) / CONFIG_NAME}"
               + (f" ({before[-1]} beside it is an older copy)" if before else ""))
    if training:
        return (f"{workdir} holds checkpoints but no {CONFIG_NAME}: the config the run trained "
                f"with is unknown; {restore}, pass --config.allow_config_change=True to continue "
                f"it with this config (recorded in {CONFIG_NAME}), or --fresh to start over (the "
                f"old run is moved to {REPLACED_DIR}/)")
    return (f"{workdir} holds checkpoints but no {CONFIG_NAME}: the config the run trained with "
            f"is unknown; {restore}, or continue the run with python main.py --config=<its config> "
            f"--workdir={workdir} --config.allow_config_change=True, which records it")


def has_checkpoint(workdir: str) -> bool:
    """Whether ``workdir/checkpoints`` holds a step folder (complete or not: a partial one means
    training ran with the saved config)."""
    root = epath.Path(workdir) / "checkpoints"  # a file or a link loop: checkpoints.py says so
    return root.is_dir() and any(is_step_name(p.name.split(".")[0]) for p in root.iterdir())


def is_step_name(name: str) -> bool:
    """A step folder's name as Orbax writes it: '60', never '0060' (which Orbax does not list)."""
    return name.isdigit() and name == str(int(name))


def saved_values(config: Any) -> dict:
    """``config`` as config.json holds it: its JSON, with ``allow_config_change`` False (a
    permission for one invocation, not a property of the run)."""
    values = json.loads(config.to_json_best_effort())
    values["allow_config_change"] = False
    return values


def write_config(config: Any, workdir: str) -> None:
    """Writes config.json (atomically). Called once the run's checkpoint restored or it starts
    at step 0, so a change refused later (a model that no longer fits, a run already complete)
    leaves it untouched. An accepted change is said in one line (one more, info, for the
    ``ALWAYS_CHANGEABLE`` keys) and keeps the old file as config.before-<time>.json."""
    path = epath.Path(workdir) / CONFIG_NAME
    current = saved_values(config)
    if not path.exists() and has_checkpoint(workdir):  # check_config let it through: the flag
        logging.warning("%s had checkpoints but no %s: continuing with the given config "
                        "(allow_config_change), now recorded in %s.", workdir, CONFIG_NAME,
                        CONFIG_NAME)
    if path.exists():
        old = path.read_text()
        saved = json.loads(old)
        diff, harmless = config_diff(saved, current), changeable_diff(saved, current)
        if not diff and not harmless:
            if saved.get("allow_config_change"):  # an older version's saved permission
                write_text_atomic(workdir, CONFIG_NAME, json.dumps(current, indent=2,
                                                                   sort_keys=True))
            return
        before = f"config.before-{utc_stamp()}.json"
        if has_checkpoint(workdir) and diff:
            logging.warning("Continuing %s with a changed config (allow_config_change): %s; the "
                            "old config is kept as %s.", workdir, ", ".join(diff), before)
        if has_checkpoint(workdir) and harmless:
            why = ("keys that need no allow_config_change; with another mesh the run continues "
                   "equal up to float32 rounding (the order of the all-reduce) rather than bit "
                   "for bit" if any(h.startswith("mesh.") for h in harmless) else
                   "keys that change neither the trained numbers nor the resume")
            logging.info("Continuing %s with %s (%s; recorded in config.json).", workdir,
                         ", ".join(harmless), why)
        (path.parent / before).write_text(old)
    write_text_atomic(workdir, CONFIG_NAME, json.dumps(current, indent=2, sort_keys=True))


def write_json_atomic(workdir: str, name: str, value: Any) -> None:
    """``<workdir>/<name>`` = JSON of ``value``, written to a temporary name and renamed."""
    write_text_atomic(workdir, name, json.dumps(value, indent=1) + "\n")


def write_text_atomic(workdir: str, name: str, text: str) -> None:
    """``<workdir>/<name>`` = ``text``, written to a temporary name and renamed (a crash leaves
    the old file or the new one, never half of one)."""
    path = epath.Path(workdir) / name
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)

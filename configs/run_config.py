"""A run's own config, read from its workdir: ``run_config.py:<workdir or its config.json>``.

main.py uses it for ``--mode=eval`` without ``--config`` and for ``--config=W/config.json`` or
``--config=W`` (a workdir), so ``--config.<key>=...`` overrides still work on it:

    python main.py --mode=eval --workdir=runs/demo --config.data.eval_split=train

The saved values are laid over configs/default.py's fields (keeping their types, so a field the
run left at None can still be set from the command line); keys the defaults lack (a norm's
options, T2T-ViT's) are added as saved. ``allow_config_change`` is read as False whatever the file
says (a permission for one invocation: ``--config.allow_config_change=True`` gives it).
"""
from __future__ import annotations

import os
from typing import Any

import ml_collections
from etils import epath

from configs import default
from normvit_jax import run_config as saved_config


def _overlay(base: ml_collections.ConfigDict, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if key in base and isinstance(base[key], ml_collections.ConfigDict) \
                and isinstance(value, dict) and key not in ("norm", "norm_overrides"):
            _overlay(base[key], value)
        elif key in base and not isinstance(value, dict) and \
                not isinstance(base[key], ml_collections.ConfigDict):
            base[key] = value  # a typed field keeps its type; None stays settable
        else:  # a dict-valued field (norm options) or a key the defaults lack: as saved
            with base.ignore_type():
                base[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value


def path_of(spec: str) -> str:
    """``W`` or ``W/config.json`` -> the config.json path."""
    return spec if spec.endswith(".json") else os.path.join(spec, "config.json")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if not arg:
        raise ValueError("run_config.py needs a workdir or a config.json after the colon, e.g. "
                         "run_config.py:runs/demo")
    path = epath.Path(path_of(arg))
    if not path.exists():
        raise ValueError(f"{path} does not exist: give a workdir of a run (it holds config.json) "
                         "or a config file ending in .py")
    return from_saved(saved_config.read_saved(path))


def from_saved(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """A config.json's values laid over configs/default.py's fields, allow_config_change False
    (an older version saved a run's True, which then granted every later re-run a change)."""
    config = default.get_config()
    _overlay(config, saved)
    config.allow_config_change = False
    return config

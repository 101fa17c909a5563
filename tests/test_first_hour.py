"""A new user's first hour (issue 15): every documented config field can be set on the command
line, failed starts leave nothing behind, bad values are refused with exit 2, and the log says
what it means once."""
from __future__ import annotations

import glob
import os
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from configs import default
from tests.conftest import REPO_ROOT

CONFIG_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO_ROOT, "configs", "*.py"))
                      if not os.path.basename(p).startswith("__") and not p.endswith("default.py"))
# model.norm is a dict of options (its `name` is set instead); model.norm_overrides starts empty:
# its keys name blocks and are added in config files, not on the command line.
NOT_LEAVES = ("model.norm_overrides",)


def _leaves(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k in c.keys():
        key = f"{prefix}{k}"
        if isinstance(c[k], ml_collections.ConfigDict):
            if key not in NOT_LEAVES:
                out += _leaves(c[k], key + ".")
        else:
            out.append(key)
    return out


def _value_for(field_type: type) -> tuple[str, object]:
    """A command-line string for a field of this type and the value it must parse to."""
    return {int: ("7", 7), float: ("0.25", 0.25), bool: ("True", True),
            str: ("some/value", "some/value")}[field_type]


def _parse(spec: str, argv_tail: list[str]) -> ml_collections.ConfigDict:
    """main.py's parser (config_flags reads the override names from sys.argv)."""
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True)
    argv = ["main.py", f"--config={spec}"] + argv_tail
    saved, sys.argv = sys.argv, argv
    try:
        fv(argv)
    finally:
        sys.argv = saved
    return fv.config


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


DEFAULT_FIELDS = _leaves(default.get_config())


def test_default_fields_are_all_typed():
    """A field whose default is a bare None cannot be set from the command line at all."""
    c = default.get_config()
    untyped = [k for k in DEFAULT_FIELDS if _get(c, k) is None and _field_type(c, k) is type(None)]
    assert not untyped, untyped
    assert len(DEFAULT_FIELDS) > 60  # the walk reached every section


def _field_type(c, key):
    *path, last = key.split(".")
    for p in path:
        c = c[p]
    return c.get_type(last)


@pytest.mark.parametrize("config_file", CONFIG_FILES)
def test_every_documented_field_is_settable_from_the_command_line(config_file):
    variants = ["", ":b32,cifar100"] if config_file == "finetune_cifar.py" else ["", ":demo"]
    base_types = {k: _field_type(default.get_config(), k) for k in DEFAULT_FIELDS}
    for variant in variants:
        spec = os.path.join(REPO_ROOT, "configs", config_file) + variant
        argv, expected = [], {}
        for key in DEFAULT_FIELDS:
            text, value = _value_for(base_types[key])
            argv.append(f"--config.{key}={text}")
            expected[key] = value
        config = _parse(spec, argv)  # raised UnsupportedOperationError for None-typed fields
        for key, value in expected.items():
            assert _get(config, key) == value, (spec, key)
        # the norm's own options stay settable too (its name is the documented switch)
        config = _parse(spec, ["--config.model.norm.name=rmsnorm"])
        assert config.model.norm.name == "rmsnorm"

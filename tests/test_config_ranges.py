"""Issue 28, point 5: every numeric key of configs/default.py has a range (or is named as one
without), each range refuses the values just outside it and accepts its bounds, and main.py
refuses an out-of-range value with exit 2, one line and nothing created."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import ml_collections
import pytest

from configs import default
from normvit_jax import cli, config_ranges, norms, preflight
from normvit_jax.config_ranges import RANGES, UNBOUNDED
from normvit_jax.models import spec as model_spec
from tests.conftest import REPO_ROOT, tiny_demo_config


def _numeric_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k in c.keys():
        key = f"{prefix}{k}"
        if isinstance(c[k], ml_collections.ConfigDict):
            out += _numeric_keys(c[k], key + ".")
        elif c.get_type(k) in (int, float):
            out.append(key)
    return out


def test_every_numeric_default_key_has_a_range_or_is_named_unbounded():
    keys = _numeric_keys(default.get_config())
    assert len(keys) > 40
    assert sorted(set(keys) - set(RANGES) - set(UNBOUNDED)) == []
    assert sorted((set(RANGES) | set(UNBOUNDED)) - set(keys)) == []  # no stale entries


def _set(config, key: str, value) -> None:
    *path, last = key.split(".")
    for p in path:
        config = config[p]
    config[last] = value


def _edges(r: config_ranges.Range) -> tuple[list, list]:
    """(values inside: the closed bounds and a point between; values just outside)."""
    step = 1 if r.integer else 1e-6
    inside, outside = [], []
    if r.low is not None:
        (outside if r.low_open else inside).append(r.low)
        outside.append(r.low - step)
        inside.append(r.low + step if r.high is None or r.low + step < r.high else r.low)
    if r.high is not None:
        (outside if r.high_open else inside).append(r.high)
        outside.append(r.high + step)
    if r.integer:
        outside.append((r.low or 0) + 1.5)  # not a whole number
    return [v for v in inside if not (r.low_open and v == r.low)], outside


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_key_refuses_values_outside_its_range_and_accepts_its_bounds(key):
    r = RANGES[key]
    inside, outside = _edges(r)
    assert inside and outside
    for value in inside:
        c = tiny_demo_config()
        _set(c, key, int(value) if r.integer else float(value))
        config_ranges.check(c)  # no error
    for value in outside:
        c = tiny_demo_config()
        with c.ignore_type():
            _set(c, key, value)
        with pytest.raises(ValueError, match=rf"^config\.{re.escape(key)}="):
            preflight.check_values(c)  # what main.py and the loop run
        with pytest.raises(ValueError) as e:
            config_ranges.check(c)
        msg, stored = str(e.value), config_ranges._get(c, key)[1]  # a float key holds 0 as 0.0
        assert stored == value
        assert msg == f"config.{key}={stored!r} is out of range; accepted: {r.describe()}"


def test_range_descriptions():
    assert config_ranges.RATE.describe() == "a number in [0, 1)"
    assert RANGES["model.depth"].describe() == "an integer >= 1"
    assert RANGES["layer_decay"].describe() == "a number in (0, 1]"
    assert not RANGES["mix_prob"].contains(float("nan"))
    assert not RANGES["model.depth"].contains(True)  # a bool is not a count


def test_heads_that_do_not_divide_the_width_are_named_with_the_divisors():
    with pytest.raises(ValueError, match=r"model.num_heads=5 does not divide model.hidden_size=32; "
                                         r"accepted: a divisor of 32: \[1, 2, 4, 8, 16, 32\]"):
        model_spec.complete_sizes({"hidden_size": 32, "depth": 1, "num_heads": 5, "patch_size": 2,
                                    "mlp_dim": 64})


def test_an_mlp_ratio_that_leaves_no_mlp_is_refused():
    sizes = {"hidden_size": 64, "depth": 1, "num_heads": 4, "patch_size": 2, "mlp_dim": None}
    with pytest.raises(ValueError, match=r"model.mlp_ratio=0.001 gives an MLP of width 0 at "
                                         r"model.hidden_size=64; accepted: a ratio >= 1/64"):
        model_spec.complete_sizes({**sizes, "mlp_ratio": 0.001})  # was a ZeroDivisionError
    cfg = {**sizes, "mlp_ratio": 1 / 64}
    model_spec.complete_sizes(cfg)
    assert cfg["mlp_dim"] == 1


@pytest.mark.parametrize("norm,key,value", [
    ("layernorm", "epsilon", -1.0), ("batchnorm", "momentum", 2.0), ("repbn", "momentum", -1.0),
    ("unified", "momentum", 1.5), ("powernorm", "alpha_fwd", -1.0),
    ("powernorm", "group_epsilon", -1e-5)])
def test_norm_options_out_of_range_are_refused(norm, key, value):
    """They built a model that trained to NaN (exit 3 blaming the learning rate) or, for a
    running-statistics momentum, finished with exit 0 and a NaN eval."""
    with pytest.raises(ValueError, match=re.escape(f"norm {norm!r}: {key}={value!r} is out of "
                                                   "range; accepted: a number")):
        norms.create({"name": norm, key: value}, dim=8, num_heads=2)
    norms.create({"name": norm, key: 0.0}, dim=8, num_heads=2)  # the bound is accepted


@pytest.mark.parametrize("override,key,shown", [
    ("--config.label_smoothing=1.5", "label_smoothing", "1.5"),
    ("--config.model.depth=0", "model.depth", "0"),
    ("--config.model.num_heads=5", "model.num_heads", "5")])
def test_main_refuses_with_exit_2_and_one_line(tmp_path, override, key, shown):
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo", override,
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if "Stopped:" in line]
    assert len(lines) == 1 and f"{key}={shown} " in lines[0] and "accepted: " in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "wd").exists() or os.listdir(tmp_path / "wd") == []


def test_none_is_refused_where_it_has_no_meaning():
    """--config.log_every=None (or mix_prob, optimizer.b1, mesh.data, ... =None) passed every
    check and ended in a TypeError traceback (exit 1) from the loop; None stays accepted where it
    means something (NONE_MEANS; a model.* key: the family's default)."""
    refused = 0
    for key in [*RANGES, *UNBOUNDED]:
        c = tiny_demo_config()
        _set(c, key, None)
        if config_ranges.none_allowed(key):
            config_ranges.check(c)  # no error
            continue
        refused += 1
        accepted = RANGES[key].describe() if key in RANGES else "an integer"
        with pytest.raises(ValueError) as e:
            preflight.check_values(c)
        assert str(e.value) == f"config.{key}=None is not accepted; accepted: {accepted}"
    assert refused > 40


def test_every_key_that_defaults_to_none_may_be_none():
    """A default is never refused: each key configs/default.py leaves None has a meaning."""
    c = default.get_config()
    nones = [k for k in [*RANGES, *UNBOUNDED] if config_ranges._get(c, k) == (True, None)]
    assert len(nones) > 5 and [k for k in nones if not config_ranges.none_allowed(k)] == []
    assert sorted(set(config_ranges.NONE_MEANS) - set(RANGES)) == []  # no stale names


@pytest.mark.parametrize("override, line", [
    ("--config.log_every=None",
     "Stopped: config.log_every=None is not accepted; accepted: an integer >= 1"),
    ("--config.data=None",  # a group: was AttributeError 'NoneType' object has no attribute ...
     "error: --config.data=None: config.data is a group of keys, not a value; set one of ["),
])
def test_main_refuses_none_without_a_meaning_in_one_line(tmp_path, override, line):
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo", override,
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "rror" in x or "Stopped" in x]
    assert len(lines) == 1 and line in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "wd").exists()


def _numeric_norm_options() -> list[tuple[str, str]]:
    """(norm, option) for every registered norm's NORM_OPTIONS field, with its dataclass default."""
    import dataclasses
    out = []
    for name in norms.registry.known_names():
        fields = {f.name: f for f in dataclasses.fields(norms.registry.resolve(name))}
        out += [(name, key) for key in config_ranges.NORM_OPTIONS if key in fields]
    return out


def test_none_for_a_numeric_norm_option_is_refused_unless_its_default_is_none():
    """--config.model.norm.epsilon=None (or momentum=None) built the model and ended in a
    TypeError traceback (unsupported operand ... NoneType) at the first step."""
    import dataclasses
    pairs = _numeric_norm_options()
    assert {("layernorm", "epsilon"), ("batchnorm", "momentum"), ("repbn", "momentum"),
            ("unified", "momentum"), ("powernorm", "alpha_fwd")} <= set(pairs)
    refused = 0
    for name, key in pairs:
        field = {f.name: f for f in dataclasses.fields(norms.registry.resolve(name))}[key]
        if field.default is None:  # None means something for this norm: not refused
            continue
        refused += 1
        accepted = config_ranges.NORM_OPTIONS[key].describe()
        with pytest.raises(ValueError) as e:
            norms.create({"name": name, key: None}, dim=8, num_heads=2)
        assert str(e.value) == f"norm {name!r}: {key}=None is not accepted; accepted: {accepted}"
    assert refused >= 15


@pytest.mark.parametrize("config, override, line", [
    ("vit_ln", "--config.model.norm.epsilon=None",
     "Stopped: norm 'layernorm': epsilon=None is not accepted; accepted: a number >= 0"),
    ("vit_bn", "--config.model.norm.momentum=None",
     "Stopped: norm 'batchnorm': momentum=None is not accepted; accepted: a number in [0, 1]"),
])
def test_main_refuses_a_none_norm_option_in_one_line(tmp_path, config, override, line):
    r = subprocess.run([sys.executable, "main.py", f"--config=configs/{config}.py:demo", override,
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "rror" in x or "Stopped" in x]
    assert len(lines) == 1 and line in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "wd").exists()

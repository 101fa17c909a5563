"""Issue 28, point 6: the shell can say what the config can: keys inside dict-valued fields by
their path (new or not), None where it is legal; and configs/ln_counterpart.py gives a method's
exact LayerNorm counterpart (its parameter tree is vit_ln's)."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from normvit_jax import cli, config_paths, models
from tests.conftest import REPO_ROOT
from tests.deploy_runs import XLA_FAST


def _config(name: str, arg: str | None) -> ml_collections.ConfigDict:
    c = importlib.import_module(f"configs.{name}").get_config(arg)
    c.lock()  # as main.py's config flag holds it
    return c


def test_split_takes_dict_valued_paths_and_none_only():
    argv = ["main.py", "--config=configs/vit_dtn.py:demo", "--config.batch_size=8",
            "--config.model.norm_overrides.block_1.name=rmsnorm", "--config.model.variant=None",
            "--config.model.norm.epsilon=1e-3", "--workdir=w"]
    rest, ours = config_paths.split(argv)
    assert rest == ["main.py", "--config=configs/vit_dtn.py:demo", "--config.batch_size=8",
                    "--workdir=w"]
    assert ours == [("model.norm_overrides.block_1.name", "rmsnorm"), ("model.variant", "None"),
                    ("model.norm.epsilon", "1e-3")]


def test_apply_sets_new_and_existing_keys_with_their_types_and_none():
    c = _config("vit_dtn", "demo")
    config_paths.apply(c, [("model.norm_overrides.block_1.name", "rmsnorm"),
                           ("model.norm_overrides.block_1.epsilon", "1e-4"),
                           ("model.norm_overrides.final.epsilon", "1e-3"),
                           ("model.norm.pool_size", "7"), ("model.norm.mix_mean", "False"),
                           ("model.variant", "None"), ("data.num_workers", "None")])
    o = c.model.norm_overrides
    assert o.block_1.to_dict() == {"name": "rmsnorm", "epsilon": 1e-4}
    assert o.final.epsilon == 1e-3 and o.final.name == "layernorm"  # the rest of it kept
    assert c.model.norm.pool_size == 7 and c.model.norm.mix_mean is False
    assert c.model.variant is None and c.data.num_workers is None
    spec = models.spec_of(c.model, num_classes=10)  # block 1's norm is the override
    assert [spec.slot_norms[i]["name"] for i in range(spec.depth + 1)] == [
        "dtn", "rmsnorm", "layernorm", "layernorm", "layernorm"]
    with pytest.raises(ValueError, match=r"unknown config key --config.model.foo: config.model "
                                         r"has no key 'foo'; accepted: \["):
        config_paths.apply(c, [("model.foo", "None")])
    with pytest.raises(ValueError, match="config.model.depth is a value, not a group of keys"):
        config_paths.apply(c, [("model.depth.x", "1")])
    with pytest.raises(ValueError, match=r"--config.model.norm.mix_mean=maybe: 'maybe' is not a bool"):
        config_paths.apply(c, [("model.norm.mix_mean", "maybe")])
    gn = _config("vit_gn", "demo")  # groups: an int placeholder, None; main.py dropped a TypeError
    with pytest.raises(ValueError, match=r"--config.model.norm.groups=abc: .*type <class 'int'>"):
        config_paths.apply(gn, [("model.norm.groups", "abc")])


def test_an_override_without_a_norm_name_is_named():
    """An option alone creates an override without 'name' (a KeyError traceback before)."""
    for path, text, shown in (("model.norm_overrides.final.epsilon", "1e-3", "{'epsilon': 0.001}"),
                              ("model.norm_overrides.block_1", "3", "3")):
        c = _config("vit_ln", "demo")
        config_paths.apply(c, [(path, text)])
        key = path[len("model."):].removesuffix(".epsilon")
        with pytest.raises(ValueError, match=re.escape(
                f"model.{key}={shown} names no norm; accepted: a norm name or a mapping with "
                f"'name', e.g. --config.model.{key}.name=layernorm")):
            models.spec_of(c.model, num_classes=10)
    c = _config("vit_ln", "demo")  # with a name the same option is an override
    config_paths.apply(c, [("model.norm_overrides.final.name", "layernorm"),
                           ("model.norm_overrides.final.epsilon", "1e-3")])
    assert models.spec_of(c.model, num_classes=10).slot_norms[-1]["epsilon"] == 1e-3


def test_a_value_for_a_group_of_keys_names_its_keys(tmp_path):
    """--config.model.norm=rmsnorm (for .name=rmsnorm): ml_collections' 'Failed to parse as a
    ConfigDict: malformed node' said nothing of what to set."""
    argv = ["main.py", "--config=configs/vit_ln.py:demo", "--config.model.norm=rmsnorm"]
    error = ValueError("flag --config.model.norm=rmsnorm: Failed to parse 'rmsnorm' as a "
                       "ConfigDict")
    assert cli.describe_flag_error(argv, error) == (
        "--config.model.norm=rmsnorm: config.model.norm is a group of keys, not a value; set one "
        "of them, e.g. --config.model.norm.name=...; accepted: ['epsilon', 'name']")


def _params(config) -> dict:
    spec = models.spec_of(config.model, num_classes=10)
    size = int(config.data.image_size)
    model = models.create(spec)
    shapes = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, size, size, 3)), train=False),
                            jax.random.key(0))
    return jax.tree.map(lambda x: (x.shape, str(x.dtype)), shapes)


METHODS = importlib.import_module("configs.ln_counterpart").METHODS


@pytest.mark.parametrize("method,variants", [(m, "demo") for m in METHODS]
                         + [("dtn", "deit_s"), ("un", "t2t_vit_14"), ("dpn", "bigvision_s16_90ep")])
def test_ln_counterpart_has_the_parameter_tree_of_vit_ln(method, variants):
    counterpart = _config("ln_counterpart", f"{method},{variants}")
    reference = _config("vit_ln", variants)
    assert _params(counterpart) == _params(reference)
    assert counterpart.model.norm.to_dict() == reference.model.norm.to_dict()
    method_config = _config(f"vit_{method}", variants)  # the recipe is the method's
    for key in ("optimizer", "schedule", "batch_size", "label_smoothing"):
        assert counterpart[key] == method_config[key]


def test_main_sets_a_block_override_and_unsets_the_variant(tmp_path):
    """The user's command: parsed, run for one step, saved in config.json as given; an unknown key
    is one line and exit 2."""
    wd = tmp_path / "wd"
    base = [sys.executable, "main.py", "--config=configs/vit_dtn.py:demo", f"--workdir={wd}"]
    # XLA's backend optimizations off (tests/deploy_runs.XLA_FAST): the compiles are its time
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "XLA_FLAGS": XLA_FAST}
    r = subprocess.run(base + ["--config.model.norm_overrides.block_1.name=rmsnorm",
                               "--config.model.variant=None", "--config.total_steps=1",
                               "--config.model.depth=3",  # DTN's class token joins at depth - 2
                               "--config.model.hidden_size=16", "--config.model.mlp_dim=16",
                               "--config.model.num_heads=2", "--config.eval_every=1",
                               "--config.eval_analysis_images=0"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == cli.EXIT_OK, r.stderr[-3000:]
    saved = json.loads((wd / "config.json").read_text())["model"]
    assert saved["norm_overrides"]["block_1"] == {"name": "rmsnorm"} and saved["variant"] is None
    r = subprocess.run(base + ["--config.model.norm_overrides.final.epsilon=tiny"], cwd=REPO_ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: --config.model.norm_overrides.final.epsilon=tiny: could not convert string to "
        "float: 'tiny'")


@pytest.mark.parametrize("typed, meant", [
    ("learning_rate", ["optimizer.learning_rate"]),  # the right name in the wrong group
    ("optimizer.lr", ["optimizer.learning_rate"]),   # initials
    ("optimizer.wd", ["optimizer.weight_decay"]),
    ("model.detph", ["model.depth"]),                # a typo
    ("data.imagesize", ["data.image_size"]),
    ("warmup_steps", ["schedule.warmup_steps"]),
    ("mixup", ["mixup_alpha"]),                      # the start of a name
    ("data.batch_size", ["batch_size", "model.patch_size", "eval_batch_size"]),
    ("model.foo", []),                               # nothing alike: no guess
])
def test_an_unknown_key_names_the_keys_it_most_likely_meant(typed, meant):
    assert config_paths.closest(_config("vit_ln", "demo"), typed) == meant


@pytest.mark.parametrize("override", ["--config.learning_rate=0.1", "--config.learning_rate=None"])
def test_main_names_the_closest_key_of_a_misplaced_one(override):
    """--config.learning_rate listed the 50 top-level keys, none of them the one meant
    (optimizer.learning_rate); =None goes through config_paths, the other through absl."""
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
                        "--workdir=/tmp/never", override], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config has no key 'learning_rate' (did you mean " \
        "--config.optimizer.learning_rate?); accepted: ['allow_config_change'" in lines[0], lines
    assert not os.path.exists("/tmp/never")


def test_none_for_a_group_is_refused_but_for_the_dict_valued_ones(tmp_path):
    """--config.optimizer=None (data, schedule, mesh) was a traceback from the first reader;
    --config.model.norm_overrides=None (no overrides) reached train/build.py's
    norm_overrides.values(): AttributeError on None."""
    c = _config("vit_ln", "demo")
    for group in ("optimizer", "data", "schedule", "mesh"):
        with pytest.raises(ValueError, match=rf"^--config.{group}=None: config.{group} is a group "
                                             r"of keys, not a value; set one of \["):
            config_paths.apply(c, [(group, "None")])
    from tests.conftest import tiny_demo_config
    c = tiny_demo_config(total_steps=1, eval_every=1, checkpoint_every=1)
    c.lock()
    config_paths.apply(c, [("model.norm_overrides", "None")])
    assert c.model.norm_overrides is None
    assert cli.run(c, str(tmp_path / "wd")) == cli.EXIT_OK
    saved = json.loads((tmp_path / "wd" / "config.json").read_text())
    assert saved["model"]["norm_overrides"] is None  # as it ran

"""Issue 35, point 9: the small-image preset, prepare's suggestion of it, and the expected run
time printed before the first step."""
from __future__ import annotations

import logging
import re
import time

import jax
import numpy as np
import pytest

from configs import default, vit_dtn, vit_ln, vit_progressive, vit_repbn
from normvit_jax.data import prepare
from normvit_jax.train import loop, progress
from tests.conftest import tiny_demo_config


@pytest.mark.parametrize("module", [vit_ln, vit_dtn, vit_repbn, vit_progressive])
def test_small32_is_a_photo_recipe_for_any_method(module):
    c = module.get_config("small32")
    assert (c.data.image_size, c.data.crop_padding, c.data.flip) == (32, 4, True)
    assert c.total_steps == default.SMALL32_STEPS and c.model.patch_size == 4
    assert c.schedule.warmup_steps < c.total_steps and c.eval_every <= c.total_steps
    if module is vit_progressive:  # the hand-over ends at 80% of the run, as the reference's
        assert c.model.norm.decay_steps == int(0.8 * c.total_steps)
    if module is vit_repbn:  # eta = 1 diverges on small photos (docs/norms.md)
        assert c.model.norm.eta_init == 0.1 and vit_repbn.get_config("demo").model.norm.eta_init == 1
    if module is vit_dtn:  # DTN's layout follows the preset's depth
        assert c.model.norm_overrides.last_2.name == "layernorm"


def _info(size: int, examples: int = 3000) -> dict:
    return {"classes": ["a", "b"], "format": "folder", "held_out": None, "ignored": [],
            "eval_split": "validation", "stats": {"mean": [0.5] * 3, "std": [0.2] * 3},
            "splits": {"train": {"examples": examples, "per_class": [examples // 2] * 2,
                                 "skipped": [], "min_size": [size, size],
                                 "max_size": [size, size]}}}


def test_prepare_suggests_the_small_image_preset_for_small_images():
    small = prepare.summary(_info(32), "pets", "/d", 1.0).splitlines()[-1]
    assert small.startswith("train: python main.py --config=configs/vit_ln.py:small32 ")
    assert "--config.data.name=pets --config.data.data_dir=/d" in small
    large = prepare.summary(_info(300), "pets", "/d", 1.0).splitlines()[-1]
    assert ":small32" not in large and "--config=configs/vit_dtn.py " in large


def test_step_measurement_leaves_the_state_alone():
    calls = []

    @jax.jit
    def step(state, batch):
        calls.append(1)  # traced once
        return jax.tree.map(lambda x: x + batch, state), {"loss": batch}

    state = {"w": jax.numpy.ones(3)}
    step_s, first_s = progress.measure_step_s(step, state, 1.0)
    np.testing.assert_array_equal(state["w"], 1.0)
    assert step_s > 0 and first_s > 0 and len(calls) == 1
    line = progress.expected_time_line(0, 900, 0.4)
    assert line.startswith("Expected run time: 900 steps x 0.4 s = 6m00s of training")
    assert "450 steps left of 900 x 0.4 s = 3m00s" in progress.expected_time_line(450, 900, 0.4)


def test_a_run_prints_its_expected_time_before_the_first_step(tmp_path, caplog, monkeypatch):
    from normvit_jax import summaries
    monkeypatch.setattr(progress, "MEASURE_MIN_STEPS", 4)  # a tiny run measures too
    measure = progress.measure_step_s

    def slow_compile(*args, **kwargs):  # the measurement (which compiles) takes 2 s more
        out = measure(*args, **kwargs)
        time.sleep(2.0)
        return out

    monkeypatch.setattr(progress, "measure_step_s", slow_compile)
    c = tiny_demo_config(**{"model.depth": 1})  # 6 steps, log every 2, checkpoint every 3
    # on the absl logger itself: a test before this one in the same worker may have left absl's
    # verbosity at WARNING (absl flags parsed, then unparsed, in-process by the export tests)
    with caplog.at_level(logging.INFO, logger="absl"):
        first = loop.train_and_evaluate(c, str(tmp_path / "w"), stop_at=3)
        text = caplog.text
        assert first["step"] == 3 and "Expected run time: 6 steps x " in text
        assert text.index("Expected run time") < text.index("step 2/6")
        # the first interval starts after the measurement: 2 tiny steps, not 2 s of compiling
        # (this read 0.9 steps/s before); the line does not say it holds a compilation
        first_rate = summaries.read_scalars(str(tmp_path / "w"))["train/steps_per_sec"][0]
        assert first_rate[0] == 2 and first_rate[1] > 2.0, first_rate
        assert re.search(r"step 2/6: .* examples/s, ETA", text), text
        caplog.clear()
        loop.train_and_evaluate(c, str(tmp_path / "w"))  # resumed: 3 left, too few to measure
    assert "Expected run time" not in caplog.text and "step 6/6" in caplog.text
    # unmeasured, the first interval holds the compilation and says so; the next one does not
    assert re.search(r"step 4/6: .* examples/s \(compilation included\), ETA", caplog.text)
    assert re.search(r"step 6/6: .* examples/s, ETA", caplog.text), caplog.text
    # ... and says what the wait before its first progress line is (a silent compile before)
    assert "Compiling the train step; the first progress line follows it (3 steps to go, " \
           "every 2 logged)." in caplog.text
    assert caplog.text.index("Compiling the train step") < caplog.text.index("step 6/6")

"""``main.py --mode=eval`` (normvit_jax/evaluation.py): a checkpoint evaluated without training
gives the training loop's last eval; ReaL top-1 on hand-made label sets; the eval-only tfds sets
under ``tfds.testing.mock_data``."""
from __future__ import annotations

import json
import os
import logging

import numpy as np
import pytest

from normvit_jax import checkpoints, cli, data, evaluation, run_config
from normvit_jax.data import real
from tests.conftest import tiny_demo_config

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")


def test_real_top1_counts_hand_made_sets():
    # argmax per row: 2, 0, 1, 3, 1 (row 4 is padding)
    logits = np.array([[0, 1, 5, 0], [9, 0, 0, 0], [0, 3, 1, 0], [0, 0, 0, 1], [0, 7, 0, 0]],
                      np.float32)
    sets = [np.array([2, 3]),   # hit
            np.array([1]),      # miss
            np.array([], int),  # empty set: not scored
            np.array([3]),      # hit
            np.array([1])]      # padding row: not scored although it would hit
    mask = np.array([1, 1, 1, 1, 0], np.float32)
    hits, counted = evaluation.real_top1_counts(logits, real.multi_hot(sets, 4), mask)
    assert (int(hits), int(counted)) == (2, 3)
    # the same rule written out in Python
    pred = logits.argmax(-1)
    scored = [i for i in range(5) if mask[i] and len(sets[i])]
    assert int(hits) == sum(pred[i] in set(sets[i].tolist()) for i in scored)


def test_real_top1_is_null_when_no_image_has_a_label_set(caplog):
    # the counts the eval step sums (raw and EMA): one split with scored images, one without
    got = evaluation._with_real_top1({"top1": 0.5, "real_hits": 3.0, "real_count": 4.0,
                                      "ema_real_hits": 0.0, "ema_real_count": 4.0})
    assert got == {"top1": 0.5, "real_top1": 0.75, "real_num_examples": 4,
                   "ema_real_top1": 0.0, "ema_real_num_examples": 4}
    with caplog.at_level(logging.WARNING):
        got = evaluation._with_real_top1({"real_hits": 0.0, "real_count": 0.0,
                                          "ema_real_hits": 0.0, "ema_real_count": 0.0})
    # not 0.0, which reads as a model that is always wrong; null in the JSON file
    assert got == {"real_top1": None, "real_num_examples": 0,
                   "ema_real_top1": None, "ema_real_num_examples": 0}
    assert json.loads(json.dumps(got))["real_top1"] is None
    assert [r.getMessage() for r in caplog.records if "ReaL" in r.getMessage()] == [
        "ReaL top-1: no image of this split has a ReaL label set (ReaL leaves some ImageNet images "
        "without one), so none is scored: real_top1 is null."]


def test_multi_hot():
    m = real.multi_hot([np.array([0, 2]), np.array([], int)], 3)
    np.testing.assert_array_equal(m, [[1, 0, 1], [0, 0, 0]])


def test_eval_mode_gives_the_training_eval_and_the_ema(tmp_path):
    from normvit_jax.train import loop
    cfg = tiny_demo_config(total_steps=2, eval_every=2, checkpoint_every=2, log_every=2,
                           ema_decay=0.9, **{"model.depth": 1})
    trained = loop.train_and_evaluate(cfg, str(tmp_path))["eval"]
    for step in (None, 2):  # the newest checkpoint, and one named by its step
        out = evaluation.evaluate_checkpoint(cfg, str(tmp_path), step)
        m = out["metrics"]
        assert out["step"] == 2 and m["num_examples"] == trained["num_examples"]
        assert m["top1"] == trained["top1"] and m["ema_top1"] == trained["ema_top1"]
        assert m["top5"] == trained["top5"]
        assert m["loss"] == pytest.approx(trained["loss"], rel=1e-6)
        assert m["ema_loss"] == pytest.approx(trained["ema_loss"], rel=1e-6)
    saved = json.loads((tmp_path / "eval_digits_test_2.json").read_text())
    assert saved["metrics"]["top1"] == trained["top1"]
    # per class, from the same forward pass: its counts add up to the split's top-1, for the
    # raw and the EMA weights, each with its picture (tests/test_eval_per_class.py: the parts)
    for p in ("", "ema_"):
        pc = saved[f"{p}per_class"]
        assert pc["classes"] == [str(i) for i in range(10)]
        assert sum(pc["examples"]) == m[f"{p}num_examples"] == 355
        hits = sum(round(t * e) for t, e in zip(pc["top1"], pc["examples"]))
        assert hits == round(m[f"{p}top1"] * 355) == sum(np.diagonal(pc["confusion"]))
        assert pc["picture"] == str(tmp_path / f"eval_digits_test_confusion{'-ema' * bool(p)}_2.png")
        assert open(pc["picture"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # a picture that cannot be drawn costs one warning, not the result file
    from normvit_jax import per_class

    def broken(*a, **k):
        raise RuntimeError("a drawing bug")
    real_picture, per_class.picture = per_class.picture, broken
    try:
        (tmp_path / "eval_digits_test_2.json").unlink()
        out = evaluation.evaluate_checkpoint(cfg, str(tmp_path))
    finally:
        per_class.picture = real_picture
    assert "picture" not in out["per_class"] and out["per_class"]["confusion"]
    assert json.loads((tmp_path / "eval_digits_test_2.json").read_text())["metrics"] == m
    with pytest.raises(FileNotFoundError, match="step 7"):
        evaluation.evaluate_checkpoint(cfg, str(tmp_path), 7)
    # a step that is not there is named before the eval split is opened (decoded, for a
    # prepared dataset or the digits: seconds to minutes before the one line)
    opened = []
    real_make = data.make_pipeline
    data.make_pipeline = lambda *a, **k: opened.append(a) or real_make(*a, **k)
    try:
        with pytest.raises(FileNotFoundError, match="step 7"):
            evaluation.evaluate_checkpoint(cfg, str(tmp_path), 7)
    finally:
        data.make_pipeline = real_make
    assert opened == []
    wider = tiny_demo_config(total_steps=2, ema_decay=0.9,
                             **{"model.hidden_size": 48, "model.depth": 1})
    with pytest.raises(run_config.ConfigChangedError, match=r"^--mode=eval: this config's model "
                       r"is not the run's: model.hidden_size: 32 -> 48 \(its config.json in "):
        evaluation.evaluate_checkpoint(wider, str(tmp_path))  # refused before anything is built
    wider.allow_config_change = True  # past that refusal: the arrays do not fit (exit 4)
    with pytest.raises(checkpoints.CheckpointMismatchError) as e:
        evaluation.evaluate_checkpoint(wider, str(tmp_path))
    # the cause first: which model keys differ from the run's config.json (the arrays' list came
    # alone), and how to evaluate with the run's own config
    assert str(e.value).startswith("this config's model is not the run's: model.hidden_size: 32 "
                                   "-> 48 (its config.json in "), str(e.value)[:300]
    assert "leave out --config" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]  # nothing written


def test_eval_results_of_a_damaged_checkpoint_move_aside_with_it(tmp_path):
    """docs/faults.md, "Damaged checkpoints": training moves a damaged step aside and saves that
    step again; --mode=eval's eval_*_<step>.json of the old weights stayed beside the new
    checkpoint, read as its metrics. It moves with the damaged step (step 3's stays); the next
    eval of the step writes the new weights' metrics."""
    from normvit_jax.train import loop
    from tests.test_tools_restore import _truncate_data
    cfg = tiny_demo_config(total_steps=6, checkpoint_every=3, eval_every=6, log_every=3,
                           **{"model.depth": 1})
    wd = str(tmp_path)
    loop.train_and_evaluate(cfg, wd)
    old6 = evaluation.evaluate_checkpoint(cfg, wd)
    evaluation.evaluate_checkpoint(cfg, wd, 3)
    _truncate_data(str(tmp_path / "checkpoints" / "6"))
    # a re-run whose step 6 differs from the damaged one (on a GPU a re-run need not be bitwise)
    cfg.optimizer.learning_rate, cfg.allow_config_change = 0.5, True
    assert loop.train_and_evaluate(cfg, wd)["step"] == 6
    assert checkpoints.complete_steps(wd) == [3, 6]
    assert sorted(p.name for p in tmp_path.glob("eval_*")) == [
        "eval_digits_test_3.json", "eval_digits_test_confusion_3.png"]
    damaged = tmp_path / "damaged_checkpoints" / "6"
    assert (damaged / "eval_digits_test_confusion_6.png").is_file()  # the picture went along
    kept = json.loads((damaged / "eval_digits_test_6.json").read_text())
    assert kept["metrics"] == old6["metrics"]
    new6 = evaluation.evaluate_checkpoint(cfg, wd)
    assert new6["metrics"]["loss"] != pytest.approx(old6["metrics"]["loss"], rel=1e-3)
    saved = json.loads((tmp_path / "eval_digits_test_6.json").read_text())
    assert saved["metrics"] == new6["metrics"] and not list(tmp_path.glob("*.tmp"))


def test_eval_mode_with_a_config_file_on_a_workdir_without_a_run(tmp_path):
    """--mode=eval --config=FILE where no run was ever started: said so, instead of "the run has
    not saved a checkpoint yet; continue it (its config is <workdir>/config.json)"."""
    cfg = tiny_demo_config(total_steps=2)
    for workdir, said in ((tmp_path / "none", "does not exist"), (tmp_path, "no config.json")):
        with pytest.raises(checkpoints.RunNotFoundError, match=said):
            evaluation.evaluate_checkpoint(cfg, str(workdir))


def test_eval_with_a_config_of_another_dataset_names_the_runs(tmp_path):
    """A run trained on a prepared dataset (--config.data.name=my_fm --config.data.data_dir=D),
    evaluated with the config file alone, stopped with "dataset 'cifar10' is not prepared",
    never naming my_fm. Now one line, exit 2, with the flags to add, before any dataset opens."""
    import os
    import subprocess
    import sys

    from normvit_jax import run_config
    from tests.conftest import REPO_ROOT
    trained = tiny_demo_config()
    trained.data.name, trained.data.data_dir = "my_fm", str(tmp_path / "d")
    run_config.write_config(trained, str(tmp_path))
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:small32",
                        f"--workdir={tmp_path}", "--mode=eval"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert (f"Stopped: the run in {tmp_path} trained on dataset 'my_fm' (data_dir {tmp_path}/d); "
            f"this config names 'cifar10': add --config.data.name=my_fm "
            f"--config.data.data_dir={tmp_path}/d") in lines[0], lines
    # the run's own dataset, another eval set: not refused here
    same = tiny_demo_config()
    same.data.name, same.data.data_dir = "my_fm", str(tmp_path / "d")
    same.data.eval_name = "other"
    run_config.check_eval_dataset(same, str(tmp_path))


def test_eval_name_is_checked_against_the_training_set():
    c = tiny_demo_config()
    c.data.eval_name = "imagenet_v2"  # an ImageNet test set for a digits model
    with pytest.raises(ValueError, match="eval_name"):
        data.validate(c)


def test_an_imagenet_test_set_for_a_run_on_a_prepared_dataset_is_refused_as_such(tmp_path):
    """README's `--mode=eval --config.data.eval_name=imagenet_v2` on a run of one's own photos:
    the ImageNet test sets are named as such, not "neither a built-in dataset (digits, cifar10,
    cifar100, imagenet2012) nor prepared ... prepare it with --name=imagenet_v2" (which prepare
    refuses: a name of tfds's catalog)."""
    from PIL import Image

    from normvit_jax.data import prepare
    for cls in ("cat", "dog"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (80 * i, 0, 0)).save(tmp_path / "src" / cls / f"{i}.png")
    prepare.main([f"--src={tmp_path}/src", "--name=my_photos", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0"])
    c = tiny_demo_config()
    c.data.name, c.data.data_dir, c.data.eval_name = "my_photos", str(tmp_path / "dd"), "imagenet_v2"
    with pytest.raises(ValueError, match=r"data.eval_name='imagenet_v2'.*accepted: None, "
                                         r"'my_photos', for imagenet2012: \['imagenet2012_real'"):
        data.validate(c)


@pytest.mark.parametrize("name,split", [("imagenet_v2", "test"), ("imagenet2012_real", "validation")])
def test_eval_only_imagenet_sets_under_mock_data(tmp_path, name, split):
    tfds = pytest.importorskip("tensorflow_datasets")
    c = tiny_demo_config()
    c.data.name, c.data.data_dir, c.data.normalize = "imagenet2012", str(tmp_path), "minus_one_one"
    c.data.eval_name, c.data.eval_split, c.data.image_size = name, split, 16
    c.eval_batch_size = 4
    with tfds.testing.mock_data(num_examples=6):
        p = data.make_pipeline(c, "eval", process_index=0, process_count=1)
        batches = list(p.eval_batches())
        p.close()
    assert len(batches) == 2 and sum(b["mask"].sum() for b in batches) == 6
    b = batches[0]
    assert b["image"].shape == (4, 16, 16, 3) and 0 <= b["label"].min() <= b["label"].max() < 1000
    if name == "imagenet2012_real":
        assert b["real"].shape == (4, 1000) and b["real"].dtype == np.uint8
        assert not batches[1]["real"][batches[1]["mask"] == 0].any()  # padding rows: empty sets
    else:
        assert "real" not in b


def test_a_long_eval_says_how_far_it_is():
    """ImageNet's 50,000 images on a CPU were minutes without a line: one every EVAL_PROGRESS_S
    seconds, none for a shorter eval and none at its last batch (its metrics line follows)."""
    from normvit_jax.train import progress
    t = iter([0.0, 10.0, 31.0, 31.5, 40.0, 65.0, 65.0, 400.0])
    p = progress.EvalProgress(50_000, 1024, clock=lambda: next(t))
    assert p.n_batches == 49
    p(1)       # 10 s: quiet
    p(4)       # 31 s: a line (the second clock read, after the sync, times it)
    p(6)       # 40 s: 8.5 s after the last line
    p(10)      # 65 s
    p(49)      # the last batch: quiet however long it took
    assert p.lines == [
        "eval: 4/49 batches (4,096 of 50,000 images), 0m32s so far, ETA 5m54s",
        "eval: 10/49 batches (10,240 of 50,000 images), 1m05s so far, ETA 4m14s"]
    short = progress.EvalProgress(13, 8, clock=iter([0.0, 100.0]).__next__)
    short(2)
    assert short.lines == []


def test_eval_step_sums_real_counts_from_its_own_forward(monkeypatch, caplog):
    """ReaL counts come out of the eval step's forward pass (no second one) and are summed over
    the split by setup.evaluate; batches without 'real' add nothing."""
    import jax
    import jax.numpy as jnp
    import optax
    from normvit_jax import models, sharding
    from normvit_jax.train import setup
    from normvit_jax.train.state import TrainState
    mdl = models.create({"variant": "Ti/4", "depth": 1, "hidden_size": 16, "num_heads": 2,
                         "mlp_dim": 32, "norm": {"name": "layernorm"}}, 6)
    v = jax.jit(mdl.init)(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    state = TrainState.create(v["params"], {}, optax.sgd(0.1), jax.random.key_data(jax.random.key(1)))
    mesh = sharding.make_mesh()
    rep = jax.tree.map(lambda _: sharding.replicated(mesh), state)
    step = setup.jit_eval_step(mdl, rep, mesh, None, evaluation.real_sums)
    rng = np.random.default_rng(0)
    batches = []
    for b in range(2):
        sets = [rng.choice(6, rng.integers(0, 3), replace=False) for _ in range(8)]
        batches.append({"image": rng.standard_normal((8, 8, 8, 3)).astype(np.float32),
                        "label": rng.integers(0, 6, 8).astype(np.int32),
                        "mask": np.array([1] * 8 if b == 0 else [1] * 5 + [0] * 3, np.float32),
                        "real": real.multi_hot(sets, 6)})
    hits = count = 0
    forward = jax.jit(lambda v, x: mdl.apply(v, x, train=False))  # one compile, not op by op
    for bt in batches:  # numpy's count from a separate forward
        pred = np.asarray(forward(v, bt["image"])).argmax(-1)
        scored = (bt["mask"] > 0) & (bt["real"].sum(-1) > 0)
        hits += int((scored & (bt["real"][np.arange(8), pred] > 0)).sum())
        count += int(scored.sum())
    assert 0 < count < 13

    class Split:
        num_examples, global_batch_size = 13, 8

        def eval_batches(self):
            return iter(batches)

    from normvit_jax.train import progress
    monkeypatch.setattr(progress, "EVAL_PROGRESS_S", 0.0)  # a progress line after every batch
    with caplog.at_level(logging.INFO, logger="absl"):  # absl's own level may be WARNING here
        metrics = setup.evaluate(step, state, Split(), mesh)
    lines = [r.getMessage() for r in caplog.records if "batches" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("eval: 1/2 batches (8 of 13 images), "), lines
    assert (metrics["real_hits"], metrics["real_count"]) == (hits, count)
    assert metrics["num_examples"] == 13
    no_real = [{k: x for k, x in bt.items() if k != "real"} for bt in batches]
    out = setup.jit_eval_step(mdl, rep, mesh, None, evaluation.real_sums)(state, no_real[0])
    assert out[1] == {}


def test_a_nonfinite_eval_is_one_warning_naming_the_step_and_recalibrate(tmp_path, caplog,
                                                                          monkeypatch):
    """A diverged running statistic (RepBN's batch norm, made NaN here as divergence leaves it)
    with finite weights: training's eval and --mode=eval wrote NaN metrics and ended in exit 0
    without a word. Now one warning each, naming the step, the metrics and recalibrate; the run
    still ends normally (its weights are fine) and the result is still written."""
    import math

    import jax
    from normvit_jax.train import loop, setup
    cfg = tiny_demo_config(total_steps=3, checkpoint_every=3, eval_every=3, **{"model.depth": 1})
    cfg.model.norm = {"name": "repbn"}
    evaluate = setup.evaluate
    monkeypatch.setattr(setup, "evaluate", lambda step, state, *a: evaluate(
        step, state.replace(batch_stats=jax.tree.map(lambda x: x * np.nan, state.batch_stats)),
        *a))
    wd = str(tmp_path)
    with caplog.at_level("WARNING"):
        trained = loop.train_and_evaluate(cfg, wd)
        result = evaluation.evaluate_checkpoint(cfg, wd)
    assert math.isnan(trained["eval"]["loss"]) and math.isnan(result["metrics"]["loss"])
    lines = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith("eval at step 3: loss nan (not finite); the running statistics "
                               f"may have diverged: python -m normvit_jax.recalibrate "
                               f"--workdir={wd} --out=DIR re-estimates them; see docs/faults.md")
    assert (tmp_path / "eval_digits_test_3.json").exists()


def test_eval_with_another_model_is_refused_unless_allowed_and_never_overwrites(tmp_path):
    """``--mode=eval --config.model.norm.epsilon=0.5`` (the run trained with 1e-6) loaded the
    checkpoint into another model, evaluated it silently (top-1 0.34 instead of 0.96 for a
    walker) and wrote over the run's eval_<...>.json: refused (exit 2) naming the keys; allowed
    with allow_config_change into a file whose name says so; keys that do not change the
    function (attention_impl, dropout, ...) may differ."""
    import os
    import subprocess
    import sys

    from normvit_jax.train import loop
    from tests.conftest import REPO_ROOT
    workdir = str(tmp_path / "run")
    cfg = tiny_demo_config(total_steps=2, eval_every=2, checkpoint_every=2, log_every=2,
                           **{"model.depth": 1})
    trained = loop.train_and_evaluate(cfg, workdir)["eval"]
    own = evaluation.evaluate_checkpoint(checkpoints.load_config(workdir), workdir)
    assert own["metrics"]["top1"] == trained["top1"]
    own_file = tmp_path / "run" / "eval_digits_test_2.json"
    before = own_file.read_text()

    changed = checkpoints.load_config(workdir)
    changed.model.norm.epsilon = 0.5
    with pytest.raises(run_config.ConfigChangedError) as e:
        evaluation.evaluate_checkpoint(changed, workdir)
    assert str(e.value).startswith(
        "--mode=eval: this config's model is not the run's: model.norm.epsilon: 1e-06 -> 0.5 "
        f"(its config.json in {workdir}); the checkpoint would be evaluated as another model: "
        "leave out those overrides (only model.attention_impl, "), str(e.value)
    assert "--config.allow_config_change=True" in str(e.value) and "\n" not in str(e.value)
    assert cli.exit_code(e.value) == cli.EXIT_CONFIG
    assert own_file.read_text() == before

    changed.allow_config_change = True
    out = evaluation.evaluate_checkpoint(changed, workdir)
    assert out["model_changes"] == {"model.norm.epsilon": [1e-06, 0.5]}
    assert out["path"] == str(tmp_path / "run" / "eval_digits_test_changed-model_2.json")
    assert out["metrics"]["loss"] != pytest.approx(trained["loss"], rel=1e-6)  # another model
    written = json.loads((tmp_path / "run" / "eval_digits_test_changed-model_2.json").read_text())
    assert written["model_changes"] == {"model.norm.epsilon": [1e-06, 0.5]}
    assert own_file.read_text() == before  # the run's own result is kept
    run = tmp_path / "run"
    assert checkpoints.eval_results(workdir, 2) == sorted(  # all move with a damaged step
        [own_file, run / "eval_digits_test_changed-model_2.json", run /
         "eval_digits_test_confusion_2.png", run / "eval_digits_test_changed-model_confusion_2.png"])

    neutral = checkpoints.load_config(workdir)  # the same function, computed otherwise
    neutral.model.attention_impl = "separate"
    neutral.model.dropout_rate = 0.3
    out = evaluation.evaluate_checkpoint(neutral, workdir)
    assert "model_changes" not in out and out["path"] == str(own_file)
    assert out["metrics"]["top1"] == trained["top1"]
    assert out["metrics"]["loss"] == pytest.approx(trained["loss"], rel=1e-5)

    # the command: one line, exit 2, nothing written
    os.remove(own_file)
    r = subprocess.run([sys.executable, "main.py", "--mode=eval", f"--workdir={workdir}",
                        "--config.model.norm.epsilon=0.5"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if "rror" in x or "Stopped" in x]
    assert len(lines) == 1 and "Stopped: --mode=eval: this config's model is not the run's: " \
        "model.norm.epsilon: 1e-06 -> 0.5" in lines[0], r.stderr[-3000:]
    assert not own_file.exists()


def test_the_readme_names_every_key_an_eval_may_change():
    import os

    from tests.conftest import REPO_ROOT
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read().split("### Evaluation without training")[1].split("\n## ")[0]
    para = " ".join(text[text.index("Its model must be the run's"):].split())
    names = [k.split(".")[-1] for k in evaluation.EVAL_NEUTRAL_MODEL_KEYS]
    names += list(evaluation.EVAL_NEUTRAL_NORM_OPTIONS)
    missing = [n for n in names if f"`{n}`" not in para and f"`model.{n}`" not in para
               and not n.endswith("dropout_rate") and n != "stochastic_depth"]
    assert missing == [] and "dropout and stochastic-depth rates" in para
    assert "changed-model_<step>.json" in para


def test_a_norm_option_absent_on_one_side_at_its_default_is_no_model_change(tmp_path):
    """A run trained with LayerNorm's epsilon named (1e-6, the class default) and evaluated with
    a config that does not name it was refused as 'model.norm.epsilon: 1e-06 -> <absent>': the
    same function. An option at another value than the class default is still a change, either
    way round."""
    import ml_collections  # pylint: disable=import-outside-toplevel
    from normvit_jax import run_config  # pylint: disable=import-outside-toplevel

    def bare_ln(**opts):
        c = tiny_demo_config()
        c.model.norm = ml_collections.ConfigDict({"name": "layernorm", **opts})
        return c

    wd = str(tmp_path)
    run_config.write_config(tiny_demo_config(), wd)  # model.norm.epsilon: 1e-06 named
    assert evaluation.model_changes(bare_ln(), wd) == {}
    assert evaluation.model_changes(bare_ln(epsilon=0.5), wd) == {
        "model.norm.epsilon": [1e-06, 0.5]}
    os.remove(os.path.join(wd, "config.json"))
    run_config.write_config(bare_ln(), wd)  # the run's config.json without epsilon
    assert evaluation.model_changes(tiny_demo_config(), wd) == {}  # 1e-6 named: the default
    assert evaluation.model_changes(bare_ln(epsilon=0.5), wd) == {
        "model.norm.epsilon": ["<absent>", 0.5]}

"""A run's workdir is self-contained for inference: training records its input statistics in
``data.json`` (normvit_jax/run_data.py); predict and export use them without the prepared
dataset, and a dataset prepared again since the run trained changes neither what they compute
(one warning says so) nor, silently, a resumed training (refused, exit 2)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import types

import jax
import numpy as np
import pytest
from etils import epath
from PIL import Image

from normvit_jax import cli, evaluation, export, predict, run_data
from normvit_jax.data import prepare, prepared
from normvit_jax.deploy import bundle
from normvit_jax.train import loop
from tests.conftest import tiny_demo_config

pytestmark = pytest.mark.usefixtures("compile_cache")

CLASSES = ["ant", "bee", "cat"]
REPREPARED = "prepared again since the run"


def _images(root, split: str, n: int, seed: int, lo: int = 0, hi: int = 120) -> None:
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        d = root / split / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            x = rng.integers(lo, hi, (12, 10, 3)) + np.eye(3, dtype=int)[c] * 120
            Image.fromarray(np.clip(x, 0, 255).astype(np.uint8)).save(d / f"{seed}_{i}.png")


def _prepare(root, src: str, overwrite: bool = False) -> None:
    prepare.main([f"--src={root}/{src}", "--name=tiny_portable", f"--data_dir={root}/dd"]
                 + (["--overwrite"] if overwrite else []))


def _config(root, **kw):
    base = {"data.name": "tiny_portable", "data.data_dir": f"{root}/dd", "data.image_size": 8,
            "data.normalize": "zscore", "data.num_workers": 1, "batch_size": 8,
            "eval_batch_size": 8, "total_steps": 2, "checkpoint_every": 2, "eval_every": 2,
            "log_every": 2, "model.depth": 1}
    base.update(kw)
    return tiny_demo_config(**base)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """src/{train,val}/<class> (8 and 3 images a class), prepared as 'tiny_portable' in dd/, and
    a 2-step run on it in run/."""
    root = tmp_path_factory.mktemp("portable")
    _images(root / "src", "train", 8, seed=1)
    _images(root / "src", "val", 3, seed=2)
    _prepare(root, "src")
    loop.train_and_evaluate(_config(root), str(root / "run"))
    return types.SimpleNamespace(root=root, run=str(root / "run"))


def _probs(workdir: str, root) -> dict[str, list]:
    rows, skipped = predict.predict(workdir, predict.list_images(f"{root}/src/val"), top_k=3)
    assert len(rows) == 9 and not skipped
    return {r["path"]: r["top"] for r in rows}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert [c for c, _ in a[k]] == [c for c, _ in b[k]], k
        np.testing.assert_allclose([p for _, p in a[k]], [p for _, p in b[k]], atol=1e-6, rtol=0)


def _copy_run(trained, tmp_path) -> str:
    dest = tmp_path / "run"
    shutil.copytree(trained.run, dest, ignore=shutil.ignore_patterns(".lock"))
    return str(dest)


def test_training_records_the_statistics_of_the_prepared_dataset(trained):
    rec = json.loads((trained.root / "run" / "data.json").read_text())
    info = prepared.describe("tiny_portable", f"{trained.root}/dd")
    assert rec["dataset"] == "tiny_portable" and rec["normalize"] == "zscore"
    assert rec["image_size"] == 8
    assert {k: rec[k] for k in run_data.STATS} == {k: info["stats"][k] for k in run_data.STATS}
    assert rec["prepared"] == {"splits": {"train": 24, "val": 9}, "classes": CLASSES}


def test_a_workdir_without_its_dataset_predicts_and_exports_the_same(trained, tmp_path):
    before = _probs(trained.run, trained.root)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    want = np.asarray(bundle.serving_fn(bundle.load(trained.run, log=None))(pixels)
                      ["probabilities"])
    dd, away = trained.root / "dd", trained.root / "dd_away"
    dd.rename(away)  # the workdir copied to a machine without the dataset
    try:
        _same(_probs(trained.run, trained.root), before)
        out = tmp_path / "m.stablehlo"
        export.run_deploy(trained.run, str(out), "stablehlo")  # what export --format= runs
        exp = jax.export.deserialize(bytearray(out.read_bytes()))
        np.testing.assert_allclose(np.asarray(exp.call(pixels)["probabilities"]), want,
                                   atol=1e-6, rtol=0)
    finally:
        away.rename(dd)


def test_an_older_workdir_without_the_record_takes_the_dataset_statistics(trained, tmp_path,
                                                                          caplog):
    before = _probs(trained.run, trained.root)
    old = _copy_run(trained, tmp_path)
    os.remove(os.path.join(old, "data.json"))  # written before data.json existed
    with caplog.at_level(logging.WARNING, logger="absl"):
        _same(_probs(old, trained.root), before)
    assert not [r for r in caplog.records if REPREPARED in r.getMessage()]


def test_a_damaged_record_is_named_in_one_line(trained, tmp_path, capsys):
    wd = _copy_run(trained, tmp_path)
    path = os.path.join(wd, "data.json")
    with open(path, "w") as f:
        f.write('{"mean": [0.3')
    with pytest.raises(SystemExit) as e:
        predict.main([f"--workdir={wd}", f"--images={trained.root}/src/val"])
    assert e.value.code == cli.EXIT_CONFIG
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"python -m normvit_jax.predict: error: {path} is not readable "
                                "JSON (") and "restore it from a copy of the run" in lines[-1]


def test_a_damaged_prepare_json_does_not_stop_a_workdir_that_has_its_record(trained, caplog):
    """The run's own statistics are in data.json: the dataset's prepare.json (damaged since) is
    only read to warn about a dataset prepared again, so it is named in a warning, not an error."""
    before = _probs(trained.run, trained.root)
    info = epath.Path(prepared.version_dir("tiny_portable", f"{trained.root}/dd")) / prepared.INFO_FILE
    good = info.read_text()
    info.write_text(good[: len(good) // 2])
    try:
        with caplog.at_level(logging.WARNING, logger="absl"):
            _same(_probs(trained.run, trained.root), before)
    finally:
        info.write_text(good)
    warned = [r.getMessage() for r in caplog.records if str(info) in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "data.json" in warned[0], warned


def test_a_reprepared_dataset_keeps_the_run_statistics_and_refuses_a_resume(trained, tmp_path,
                                                                            caplog):
    wd = _copy_run(trained, tmp_path)
    root = trained.root
    before = _probs(wd, root)
    cfg = _config(root)
    before_eval = evaluation.evaluate_checkpoint(cfg, wd)["metrics"]
    old_rec = json.loads((tmp_path / "run" / "data.json").read_text())
    # more (brighter) train photos, the same val images: other statistics, other sizes
    shutil.copytree(root / "src", root / "src2")
    _images(root / "src2", "train", 3, seed=3, lo=100, hi=136)
    _prepare(root, "src2", overwrite=True)
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="absl"):
            _same(_probs(wd, root), before)  # normalized as the model was trained
        warned = [r.getMessage() for r in caplog.records if REPREPARED in r.getMessage()]
        assert len(warned) == 1 and "examples of train 24 -> 33" in warned[0], warned
        assert "mean [" in warned[0] and f"{wd}/data.json" in warned[0]
        older = tmp_path / "older"  # without the record: the new statistics, other numbers
        shutil.copytree(wd, older)
        (older / "data.json").unlink()
        moved = _probs(str(older), root)
        assert max(abs(dict(before[k])[c] - dict(moved[k])[c]) for k in before
                   for c in CLASSES) > 1e-3

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="absl"):  # --mode=eval: the same metrics
            after_eval = evaluation.evaluate_checkpoint(cfg, wd)["metrics"]
        assert len([r for r in caplog.records if REPREPARED in r.getMessage()]) == 1
        for k in ("top1", "loss", "num_examples"):
            np.testing.assert_allclose(after_eval[k], before_eval[k], atol=1e-6, rtol=0)

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="absl"):
            assert cli.run(cfg, wd) == cli.EXIT_CONFIG  # resuming would not be exact
        stopped = [r.getMessage() for r in caplog.records if "prepared again" in r.getMessage()]
        assert len(stopped) == 1 and "\n" not in stopped[0], stopped
        assert "examples of train 24 -> 33" in stopped[0]
        assert "--config.allow_config_change=True" in stopped[0]
        assert json.loads((tmp_path / "run" / "data.json").read_text()) == old_rec

        more = _config(root, total_steps=4, allow_config_change=True)
        assert cli.run(more, wd) == cli.EXIT_OK  # allowed: continues on the new data
        rec = json.loads((tmp_path / "run" / "data.json").read_text())
        stats = prepared.describe("tiny_portable", f"{root}/dd")["stats"]
        assert rec["mean"] == stats["mean"] and rec["prepared"]["splits"]["train"] == 33
        kept = sorted(tmp_path.glob("run/data.before-*.json"))
        assert len(kept) == 1 and json.loads(kept[0].read_text()) == old_rec
    finally:
        _prepare(root, "src", overwrite=True)  # the module's dataset as it was
    assert prepared.describe("tiny_portable", f"{root}/dd")["stats"]["mean"] == old_rec["mean"]


def test_fresh_moves_the_record_aside_with_the_run(tmp_path):
    from normvit_jax import workdir
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    for name in ("config.json", "data.json", "data.before-20260101T000000Z.json"):
        (tmp_path / name).write_text("{}")
    dest = workdir.move_run_aside(str(tmp_path))
    assert sorted(os.listdir(dest)) == ["checkpoints", "config.json",
                                        "data.before-20260101T000000Z.json", "data.json"]
    assert sorted(os.listdir(tmp_path)) == ["replaced"]


@pytest.mark.parametrize("damage", ["truncated", "not a list"])
def test_a_damaged_classes_json_stops_a_resume_in_one_line(trained, tmp_path, caplog, damage):
    """A truncated classes.json in a resumable run: training exited 0 and wrote it again without
    a word (predict refuses it, exit 2; a damaged data.json stops the resume, exit 2). Now the
    same as data.json: one line naming it and how to restore it, exit 2, the file left as it
    is."""
    wd = _copy_run(trained, tmp_path)
    path = os.path.join(wd, "classes.json")
    bad = {"truncated": '["ant", "be', "not a list": '{"ant": 0}'}[damage]
    with open(path, "w") as f:
        f.write(bad)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        assert cli.run(_config(trained.root, total_steps=4, allow_config_change=True),
                       wd) == cli.EXIT_CONFIG
    stopped = [r.getMessage() for r in caplog.records if "classes.json" in r.getMessage()]
    assert len(stopped) == 1 and "\n" not in stopped[0], stopped
    assert path in stopped[0] and "restore it" in stopped[0] and "delete it" in stopped[0]
    assert open(path).read() == bad

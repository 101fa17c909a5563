"""Your own data end to end, through the commands a user runs: prepare a tiny image folder, train
by name (classes and statistics from the dataset), resume, evaluate, predict; per-host reading."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from normvit_jax import checkpoints, cli, data, models, predict
from normvit_jax.data import prepare, prepared, stats
from normvit_jax.train import loop
from tests.conftest import REPO_ROOT, tiny_demo_config

# Runs that compile the same programs again (a straight run, then stop + resume) load them from
# JAX's persistent compilation cache (tests/conftest.py: compile_cache) instead of compiling.
pytestmark = pytest.mark.usefixtures("compile_cache")

CLASSES = ["ant", "bee", "cat"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """src/{train,val}/<class>: 8 train and 3 val images per class (PNG and JPEG, one gray),
    12x10 px, tinted by class; prepared as 'tiny_own' in dd/."""
    root = tmp_path_factory.mktemp("own")
    rng = np.random.default_rng(1)
    for split, n in (("train", 8), ("val", 3)):
        for c, name in enumerate(CLASSES):
            d = root / "src" / split / name
            d.mkdir(parents=True)
            for i in range(n):
                x = rng.integers(0, 120, (12, 10, 3)) + np.eye(3, dtype=int)[c] * 120
                img = Image.fromarray(x.astype(np.uint8))
                if i == 0:
                    img = img.convert("L")
                img.save(d / (f"{i}.png" if i % 2 else f"{i}.jpg"))
    prepare.main([f"--src={root}/src", "--name=tiny_own", f"--data_dir={root}/dd"])
    return root


def _config(root, **kw):
    base = {"data.name": "tiny_own", "data.data_dir": f"{root}/dd", "data.image_size": 8,
            "data.normalize": "zscore", "data.num_workers": 1, "batch_size": 8,
            "eval_batch_size": 8, "total_steps": 4, "checkpoint_every": 2, "eval_every": 4,
            "log_every": 2, "model.depth": 1}
    base.update(kw)
    return tiny_demo_config(**base)


def test_spec_comes_from_the_dataset_files(dataset):
    ds = data.resolve_data_spec(_config(dataset))
    info = prepared.describe("tiny_own", f"{dataset}/dd")
    assert ds.num_classes == 3 and ds.class_names == tuple(CLASSES)
    assert ds.eval_split == "val"  # the default 'test' is absent: the dataset's own eval split
    np.testing.assert_allclose(ds.mean, info["stats"]["mean"])
    want = stats.affine_of({k: np.asarray(info["stats"][k], np.float32) for k in
                            ("mean", "std", "min", "max")}, "zscore")
    np.testing.assert_allclose(ds.affine[0], want[0])


def test_finetune_config_takes_any_prepared_dataset(dataset):
    from configs import finetune
    c = finetune.get_config("b16,augreg")
    c.data.name, c.data.data_dir = "tiny_own", f"{dataset}/dd"
    ds = data.resolve_data_spec(c)
    assert (ds.num_classes, ds.train_split, ds.eval_split) == (3, "train", "val")
    assert c.init_from.startswith("gs://vit_models/augreg/B_16")  # its head is reset to 3 classes


def test_unprepared_name_and_missing_split_are_clear(dataset):
    with pytest.raises(data.DatasetNotFoundError, match="normvit_jax.data.prepare"):
        data.resolve_data_spec(_config(dataset, **{"data.name": "not_there"}))
    with pytest.raises(ValueError, match=r"does not have; accepted: \['train', 'val'\]"):
        data.resolve_data_spec(_config(dataset, **{"data.eval_split": "validation"}))


def test_train_resume_eval_predict(dataset, tmp_path, capsys, monkeypatch):
    cfg = _config(dataset)
    straight = loop.train_and_evaluate(cfg, str(tmp_path / "a"))
    assert straight["step"] == 4 and straight["eval"]["num_examples"] == 9
    first = loop.train_and_evaluate(cfg, str(tmp_path / "b"), stop_at=2)
    assert first["step"] == 2
    loop.train_and_evaluate(cfg, str(tmp_path / "b"))
    a, _ = checkpoints.load_params(str(tmp_path / "a"))
    b, _ = checkpoints.load_params(str(tmp_path / "b"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):  # resume: bit-identical
        np.testing.assert_array_equal(x, y)
    assert a["head"]["bias"].shape == (3,)
    assert json.loads((tmp_path / "a" / "classes.json").read_text()) == CLASSES

    assert cli.evaluate(cfg, str(tmp_path / "a")) == 0
    ev_val = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev_val["split"] == "val" and ev_val["metrics"]["num_examples"] == 9

    # predict on the val files == the model on the eval pipeline's val batches (same decoder)
    out = tmp_path / "preds.csv"
    monkeypatch.setattr(predict, "PROGRESS_MIN_IMAGES", 9)  # the bars of a long prediction
    rows, skipped = predict.main([f"--workdir={tmp_path}/a", f"--images={dataset}/src/val",
                                  "--top_k=3", f"--out={out}"])
    assert len(rows) == 9 and not skipped
    err = capsys.readouterr().err
    assert "predicting" in err and "/9 [" in err, err[-2000:]  # one pass: read + predict
    monkeypatch.setattr(predict, "PROGRESS_MIN_IMAGES", 10)  # one image fewer: no bar
    predict.main([f"--workdir={tmp_path}/a", f"--images={dataset}/src/val", f"--out={out}"])
    assert "predicting" not in capsys.readouterr().err
    assert all({c for c, _ in r["top"]} == set(CLASSES) for r in rows)
    assert all(r["top"][0][1] >= r["top"][1][1] >= r["top"][2][1] for r in rows)
    with open(out) as f:
        assert len(list(csv.reader(f))) == 10
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("no image")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # nothing readable: no empty CSV, no exit 0
        predict.main([f"--workdir={tmp_path}/a", f"--images={tmp_path}/notes",
                      f"--out={tmp_path}/none.csv"])
    assert e.value.code == 2 and not (tmp_path / "none.csv").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m normvit_jax.predict: error: none of the 1 file(s) of --images is a readable "
        "image")
    variables, config = checkpoints.load_variables(str(tmp_path / "a"))
    ds = data.resolve_data_spec(config)
    model = models.create(config.model, 3)
    pipe = data.make_pipeline(config, "eval", ds)
    ref = []
    for batch in pipe.eval_batches():
        x = stats.model_input(batch["image"], ds.affine)
        p = np.asarray(jax.nn.softmax(model.apply(variables, x, train=False), -1), np.float64)
        ref += sorted(p[batch["mask"] > 0].max(-1).tolist())
    np.testing.assert_allclose(sorted(r["top"][0][1] for r in rows), sorted(ref), atol=1e-5)

    # a reparam-folded model predicts the same (LayerNorm's affine folded into the next Dense)
    from normvit_jax import reparam
    reparam.main([f"--workdir={tmp_path}/a", f"--out={tmp_path}/folded", "--batch=2", "--reps=1"])
    folded, _ = predict.predict(str(tmp_path / "a"), [r["path"] for r in rows], top_k=3,
                                folded=str(tmp_path / "folded"))
    for r, f in zip(rows, folded):
        assert [c for c, _ in f["top"]] == [c for c, _ in r["top"]]
        np.testing.assert_allclose([p for _, p in f["top"]], [p for _, p in r["top"]], atol=1e-5)

    # --mode=eval through predict on another prepared split
    assert predict.main([f"--workdir={tmp_path}/a", "--mode=eval", "--split=train"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["split"] == "train" and ev["metrics"]["num_examples"] == 24
    # another prepared set of the same classes (here the val images again, as a train-only set):
    # evaluated with the run's normalization, the same metrics as the run's own val split
    prepare.main([f"--src={dataset}/src/val", "--name=tiny_again", f"--data_dir={dataset}/dd",
                  "--val_fraction=0"])
    capsys.readouterr()
    assert predict.main([f"--workdir={tmp_path}/a", "--mode=eval", "--name=tiny_again",
                         "--split=train"]) == 0
    other = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (other["dataset"], other["split"]) == ("tiny_again", "train")
    assert other["metrics"]["num_examples"] == 9
    for key, want in ev_val["metrics"].items():
        assert other["metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
    two = dataset / "two"  # other classes: refused, naming both sets' classes
    for name in CLASSES[:2]:
        os.makedirs(two / name)
        for f in os.listdir(dataset / "src" / "val" / name):
            os.link(dataset / "src" / "val" / name / f, two / name / f)
    prepare.main([f"--src={two}", "--name=tiny_two", f"--data_dir={dataset}/dd",
                  "--val_fraction=0"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        predict.main([f"--workdir={tmp_path}/a", "--mode=eval", "--name=tiny_two",
                      "--split=train"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m normvit_jax.predict: error: --name=tiny_two has the classes "
        "['ant', 'bee'], the run's 'tiny_own' ['ant', 'bee', 'cat']; accepted: a prepared dataset "
        "of the same classes (prepare it from folders of the same names)")
    with pytest.raises(SystemExit) as e:  # the tool's one line, not main.py's 'Stopped:' log line
        predict.main([f"--workdir={tmp_path}/a", "--mode=eval", "--split=nosuch"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "python -m normvit_jax.predict: error: --split=nosuch names 'nosuch'")


def test_predict_bad_input_is_one_line_exit_2(dataset, tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text(_config(dataset).to_json())
    for argv in ([f"--workdir={tmp_path}/none", f"--images={dataset}/src/val"],
                 [f"--workdir={tmp_path}/w", "--images=/no/such/file.png"]):
        with pytest.raises(SystemExit) as e:
            predict.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().startswith("python -m normvit_jax.predict: error: ")
    # a folded model of another run, with 5 classes where this run has 3: refused, not numbered
    from normvit_jax import reparam
    from normvit_jax.deploy import bundle, errors
    cfg = _config(dataset)
    variables = models.create(cfg.model, 5).init(jax.random.key(0), np.zeros((1, 8, 8, 3)),
                                                 train=False)
    reparam.save(str(tmp_path / "f5"), cfg.model, variables, 5)
    with pytest.raises(SystemExit) as e:
        predict.main([f"--workdir={tmp_path}/w", f"--images={dataset}/src/val",
                      f"--folded={tmp_path}/f5"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"python -m normvit_jax.predict: error: --folded={tmp_path}/f5 holds a model of 5 "
        f"classes, but the run {tmp_path}/w has 3; fold this run: python -m normvit_jax.reparam "
        f"--workdir={tmp_path}/w --out=DIR")
    # --folded is one model: a --step beside it, or --mode=eval (which reads checkpoints), went
    # unused without a word
    for extra, says in ((["--step=3"], "--step=3 picks a checkpoint, but --folded="),
                        (["--mode=eval"], "--mode=eval evaluates the run's checkpoints, not ")):
        with pytest.raises(SystemExit) as e:
            predict.main([f"--workdir={tmp_path}/w", f"--images={dataset}/src/val",
                          f"--folded={tmp_path}/f5", *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert err.startswith(f"python -m normvit_jax.predict: error: {says}"), err
    with pytest.raises(errors.DeployError, match="holds a model of 5 classes"):  # export's path
        bundle.load(f"{tmp_path}/w", folded=f"{tmp_path}/f5", log=None)
    for flag in ("--batch=0", "--batch=-3", "--top_k=0"):  # before the run is read
        with pytest.raises(SystemExit) as e:
            predict.main([f"--workdir={tmp_path}/w", f"--images={dataset}/src/val", flag])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"python -m normvit_jax.predict: error: {flag}: must be >= 1")


def test_a_damaged_dataset_file_is_named_not_a_traceback(dataset, tmp_path):
    """A shard cut short after prepare wrote it: array_record's RuntimeError was a traceback."""
    import glob
    import shutil
    shutil.copytree(dataset / "dd", tmp_path / "dd")
    shard, = glob.glob(f"{tmp_path}/dd/tiny_own/1.0.0/tiny_own-val.array_record*")
    os.truncate(shard, 500)
    cfg = _config(dataset, **{"data.data_dir": f"{tmp_path}/dd"})
    with pytest.raises(ValueError, match=r"^tiny_own:val: its array_record files cannot be read "
                                         r"\(.*\); one was damaged after it was written: prepare "
                                         r"the dataset again"):
        data.make_pipeline(cfg, "eval", data.resolve_data_spec(cfg))


def test_two_hosts_read_disjoint_rows_that_make_the_global_batch(dataset):
    cfg = _config(dataset, **{"data.return_index": True})
    ds = data.resolve_data_spec(cfg)
    one = data.make_pipeline(cfg, "train", ds, process_index=0, process_count=1)
    hosts = [data.make_pipeline(cfg, "train", ds, process_index=i, process_count=2)
             for i in range(2)]
    for step in (0, 3, 5):  # 3 steps per epoch: within and across epochs
        whole = one.train_batch(step)
        parts = [h.train_batch(step) for h in hosts]
        for key in ("image", "label", "index"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    epoch = np.concatenate([one.train_batch(s)["index"] for s in range(3)])
    assert sorted(epoch.tolist()) == list(range(24))


def test_main_py_names_prepare_for_an_unprepared_dataset(dataset, tmp_path):
    """(main.py training on a prepared dataset: the two-process test below runs it unchanged.)"""
    r = subprocess.run(
        [sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
         "--config.data.name=not_prepared", f"--config.data.data_dir={dataset}/dd",
         f"--workdir={tmp_path}/run2"], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert r.returncode == 2 and "normvit_jax.data.prepare" in r.stderr


@pytest.mark.multiprocess
def test_two_processes_read_their_halves_and_train_like_one(dataset, tmp_path):
    """launch/local.sh with 2 processes x 2 CPU devices against one process with 4 devices."""
    from tests.deploy_runs import XLA_FAST
    from tests.test_multiprocess import _env, assert_state_close, read_record
    cfg = "tests/own_data_multiproc_config.py"
    rec = lambda phase, kind="train": str(tmp_path / f"{phase}.{kind}.{{process}}")  # noqa: E731
    extra = dict(NORMVIT_TEST_OWN_DATA_DIR=f"{dataset}/dd")
    logs = tmp_path / "logs"
    with open(tmp_path / "local.err", "w+") as err:  # both runs at once: their start-ups overlap
        two = subprocess.Popen(
            ["bash", "launch/local.sh", "--processes=2", "--cpu-devices=2", "--grace=3",
             f"--log-dir={logs}", cfg, str(tmp_path / "run")], cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL, stderr=err,
            env=_env(tmp_path, NORMVIT_TEST_RECORD=rec("two"),
                     NORMVIT_TEST_RECORD_EVAL=rec("two", "eval"), **extra))
        try:
            ref = subprocess.run(
                [sys.executable, "tests/fault_main.py", f"--config={cfg}",
                 f"--workdir={tmp_path}/ref"], cwd=REPO_ROOT, capture_output=True, text=True,
                timeout=600, env=_env(tmp_path, JAX_PLATFORMS="cpu", NORMVIT_TEST_RECORD=rec("ref"),
                                      NORMVIT_TEST_RECORD_EVAL=rec("ref", "eval"),
                                      XLA_FLAGS=XLA_FAST + " --xla_force_host_platform_device_count=4",
                                      **extra))
            assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
            if two.wait(600) != 0:
                err.seek(0)
                pytest.fail(err.read()[-2000:] + "".join(
                    p.read_text()[-2000:] for p in logs.glob("process_*.log")))
        finally:
            if two.poll() is None:
                two.kill()
                two.wait()
    a, _ = checkpoints.load_state(str(tmp_path / "run"), 3)
    b, _ = checkpoints.load_state(str(tmp_path / "ref"), 3)
    assert_state_close(a, b)
    rows = read_record(tmp_path / "ref.train.0")
    assert len(rows) == 3 and sorted(x for r in rows for x in r) == list(range(24))
    for i in range(2):
        assert read_record(tmp_path / f"two.train.{i}") == [r[4 * i:4 * i + 4] for r in rows]
    seen = [x for i in range(2) for r in read_record(tmp_path / f"two.eval.{i}") for x in r]
    assert sorted(seen) == list(range(9))
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == CLASSES

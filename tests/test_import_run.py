"""``main.py --mode=import``: a model trained in PyTorch (timm's ViT names; SLAB's RepBN names) written
as a run of step 0, evaluated as it is, folded and exported (docs/pretrained.md, "Evaluate, fold
and export a model trained elsewhere").

Reference: tests/test_pretrained_timm.reference, a float64 numpy forward of timm's
VisionTransformer read from the raw state dict (exact GELU; SLAB RepBN's eval,
tests/test_pretrained_originals.repbn_eval, in every norm slot), on the same images with timm's
preprocessing (x/255 - IMAGENET_DEFAULT_MEAN) / IMAGENET_DEFAULT_STD written here from timm's
constants. Tiny models (width 8, 2 blocks, patch 4) on the bundled 8x8 digits.
Tolerances: eval top-1 equal (355 test images); the ONNX artifact (onnxruntime in a process that
does not import normvit_jax, tests/artifact_runner.py) within 1e-4 of the reference's softmax.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from normvit_jax import cli
from normvit_jax.data import digits
from tests import deploy_runs
from tests.test_pretrained_originals import repbn_eval, repbn_tensors, with_norms
from tests.test_pretrained_timm import D, DEPTH, H, MLP, P, reference, timm_sd

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMM_MEAN, TIMM_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
MODEL = {"hidden_size": D, "depth": DEPTH, "num_heads": H, "mlp_dim": MLP, "patch_size": P,
         "gelu_approximate": False}


def timm_input(x01: np.ndarray) -> np.ndarray:
    """timm's eval transform after the resize: ToTensor then Normalize(IMAGENET_DEFAULT_*)."""
    return (np.asarray(x01, np.float64) - TIMM_MEAN) / TIMM_STD


def ten_class_head(sd: dict, norm=None, scale: float = 2.0) -> dict:
    """``sd`` with a random 10-class head (digits), scaled so that the reference's logits on the
    digits have standard deviation ``scale`` (probabilities that are not all 0 or 1)."""
    r = np.random.default_rng(5)
    sd = dict(sd, **{"head.weight": r.normal(size=(10, D)).astype(np.float32),
                     "head.bias": (r.normal(size=10) * 0.1).astype(np.float32)})
    s = scale / reference(sd, timm_input(digits.load("test")[0][:64]), norm=norm).std()
    return dict(sd, **{"head.weight": sd["head.weight"] * np.float32(s),
                       "head.bias": sd["head.bias"] * np.float32(s)})


def overrides(path) -> list[str]:
    return [f"--config.model.{k}={v}" for k, v in MODEL.items()] + [
        "--config.data.normalize=imagenet", "--config.eval_analysis_images=0",
        f"--config.init_from={path}"]


def run(args: list[str], cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT}, timeout=300)


def test_slab_repbn_file_imports_evaluates_folds_and_exports(tmp_path):
    """import -> --mode=eval top-1 = the reference's; a second import into the run refused in one
    line; export --format=onnx --fold folds every RepBN slot and the input normalization, and
    onnxruntime's probabilities on uint8 PNGs are the reference's softmax within 1e-4."""
    sd = ten_class_head(with_norms(7, repbn_tensors), norm=repbn_eval)
    path = tmp_path / "slab_repbn.safetensors"
    save_file(sd, str(path))
    wd = tmp_path / "imported"
    cmd = ["main.py", "--mode=import", "--config=configs/vit_repbn.py:demo", *overrides(path),
           f"--workdir={wd}"]
    r = run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "alpha -> eta" in r.stderr and "eval at step 0" in r.stderr
    for f in ("config.json", "classes.json", "data.json", "code.jsonl", "checkpoints/0"):
        assert (wd / f).exists(), f
    assert json.loads((wd / "data.json").read_text())["normalize"] == "imagenet"

    x, y = digits.load("test")
    want_top1 = float(np.mean(reference(sd, timm_input(x), norm=repbn_eval).argmax(1) == y))
    r = run(["main.py", "--mode=eval", f"--workdir={wd}"])
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])["metrics"]
    assert got["num_examples"] == len(y) == 355
    assert abs(got["top1"] - want_top1) < 1e-6, (got["top1"], want_top1)

    r = run(cmd)  # the workdir holds a run now: refused, nothing changed
    assert r.returncode == cli.EXIT_CONFIG and "Traceback" not in r.stderr
    stopped = [line for line in r.stderr.splitlines() if "Stopped:" in line]
    assert len(stopped) == 1 and "already holds a run" in stopped[0] and "--fresh" in stopped[0]

    onnx = tmp_path / "art" / "model.onnx"
    r = run(["-m", "normvit_jax.export", f"--workdir={wd}", "--format=onnx", "--fold",
             f"--out={onnx}"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert log.count("folded repbn") == 2 * DEPTH + 1 and "folded the input normalization" in log

    images = deploy_runs.write_images(str(tmp_path / "images"), n=8)
    jobs = {"images": images, "out": str(tmp_path / "probs.npz"),
            "artifacts": {"onnx": {"repbn_folded": str(onnx)}}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = run([os.path.join(REPO_ROOT, "tests", "artifact_runner.py"), str(tmp_path / "jobs.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    from PIL import Image
    u8 = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in images])
    logits = reference(sd, timm_input(u8 / 255.0), norm=repbn_eval)
    e = np.exp(logits - logits.max(1, keepdims=True))
    probs = np.load(tmp_path / "probs.npz")["onnx/repbn_folded/probabilities"]
    assert 0.05 < probs.max(1).mean() < 0.99  # not saturated: the comparison means something
    np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), rtol=0, atol=1e-4)


def test_timm_file_import_then_fine_tune_resumes_from_step_0(tmp_path):
    """In process: a timm LayerNorm file imported (its eval top-1 = the reference's), then the same
    config trains on from the step-0 checkpoint (a fine-tune of the imported weights)."""
    import jax

    from normvit_jax.train import importer, loop
    from tests.conftest import tiny_demo_config

    sd = ten_class_head(timm_sd(3, grid=2))
    save_file(sd, str(tmp_path / "timm.safetensors"))
    cfg = tiny_demo_config(**{f"model.{k}": v for k, v in MODEL.items()},
                           **{"data.normalize": "imagenet", "total_steps": 2,
                              "checkpoint_every": 2, "eval_every": 2,
                              "init_from": str(tmp_path / "timm.safetensors")})
    wd = str(tmp_path / "w")
    result = importer.import_run(cfg, wd)
    x, y = digits.load("test")
    want = float(np.mean(reference(sd, timm_input(x)).argmax(1) == y))
    assert result["step"] == 0 and abs(result["eval"]["top1"] - want) < 1e-6
    imported = jax.tree.map(np.asarray, result["state"].params)
    done = loop.train_and_evaluate(cfg, wd)
    assert done["step"] == 2 and sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["0", "2"]
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                         done["state"].params, imported)
    assert 0 < max(jax.tree.leaves(moved)) < 0.05  # two Adam steps of lr <= 3e-3 from the import


def test_import_refuses_no_init_from_and_an_existing_run(tmp_path):
    from normvit_jax.train import importer
    from tests.conftest import tiny_demo_config
    cfg = tiny_demo_config()
    with pytest.raises(ValueError, match="needs --config.init_from=FILE"):
        importer.check_importable(cfg, str(tmp_path), fresh=False)
    cfg.init_from = "x.safetensors"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run.*--fresh"):
        importer.check_importable(cfg, str(tmp_path), fresh=False)
    importer.check_importable(cfg, str(tmp_path), fresh=True)  # --fresh moves it aside


def test_a_dataset_not_here_writes_the_run_without_eval(tmp_path, monkeypatch, caplog):
    """ImageNet for a DeiT need not be on the machine that imports it: the run is written (one
    warning), and evaluates where the dataset is (here: the digits again) as the reference."""
    from normvit_jax import data, evaluation
    from normvit_jax.train import importer
    from tests.conftest import tiny_demo_config

    sd = ten_class_head(timm_sd(4, grid=2))
    save_file(sd, str(tmp_path / "timm.safetensors"))
    cfg = tiny_demo_config(**{f"model.{k}": v for k, v in MODEL.items()},
                           **{"data.normalize": "imagenet",
                              "init_from": str(tmp_path / "timm.safetensors")})
    wd = str(tmp_path / "w")

    def not_here(*a, **k):
        raise data.DatasetNotFoundError("dataset 'digits' is not prepared in /nowhere; no download")
    with monkeypatch.context() as m:
        m.setattr(data, "make_pipeline", not_here)
        result = importer.import_run(cfg, wd)
    assert result["eval"] == {} and os.path.isdir(os.path.join(wd, "checkpoints", "0"))
    assert any("cannot be opened here" in r.getMessage() for r in caplog.records)
    got = evaluation.evaluate_checkpoint(cfg, wd, None)["metrics"]["top1"]
    x, y = digits.load("test")
    assert abs(got - float(np.mean(reference(sd, timm_input(x)).argmax(1) == y))) < 1e-6


def test_import_with_a_reinitialised_head_warns_and_so_do_the_tools(tmp_path, caplog):
    """A file whose head has another class count is imported with a zero head: the import said
    only 'eval top-1 0.1', and predict/export of the workdir gave uniform probabilities without a
    word. The import, and every tool restoring that step (checkpoints.restore_weights: predict,
    export, reparam, analysis), now warn in one line."""
    from normvit_jax import checkpoints
    from normvit_jax.train import importer
    from tests.conftest import tiny_demo_config

    save_file(timm_sd(4, grid=2), str(tmp_path / "timm.safetensors"))  # a 5-class head
    cfg = tiny_demo_config(**{f"model.{k}": v for k, v in MODEL.items()},
                           **{"data.normalize": "imagenet", "eval_analysis_images": 0,
                              "init_from": str(tmp_path / "timm.safetensors")})
    wd = str(tmp_path / "w")
    importer.import_run(cfg, wd)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert ("The imported head is zeros (re-initialised for the dataset's 10 classes; the report's "
            "head rows say why): every image gets probability 1/10 until the run is trained, so "
            "predict and export of this workdir mean nothing before a fine-tune "
            "(docs/pretrained.md).") in warned
    caplog.clear()
    checkpoints.restore_weights(wd)
    warned = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and "zeros" in r.getMessage()]
    assert warned == [f"{wd} step 0: the head is all zeros (an import whose head was re-initialised "
                      "for 10 classes?): every image gets probability 1/10; train the run first "
                      "(docs/pretrained.md)."]
    caplog.clear()
    ten = ten_class_head(timm_sd(4, grid=2))  # a head that fits: loaded, no warning
    save_file(ten, str(tmp_path / "ten.safetensors"))
    cfg.init_from, cfg.data.normalize = str(tmp_path / "ten.safetensors"), "minus_one_one"
    caplog.set_level("INFO")
    from absl import logging as absl_logging
    verbosity = absl_logging.get_verbosity()  # an earlier test's main.py may have lowered it
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        importer.import_run(cfg, str(tmp_path / "w10"), evaluate=False)
    finally:
        absl_logging.set_verbosity(verbosity)
    checkpoints.restore_weights(str(tmp_path / "w10"))
    assert not [r for r in caplog.records if "zeros" in r.getMessage()]
    # the loop passes data.normalize to the report: a timm file read as [-1, 1] inputs is noted
    assert any("note: inputs are data.normalize='minus_one_one'" in r.getMessage()
               for r in caplog.records)

"""Per-class results of ``--mode=eval`` (normvit_jax/per_class.py): the device sums against numpy's
counts on random logits, the summary on a hand-made matrix, the log line, the picture, and the
result file's layout. The whole path on a trained run: tests/test_evaluation.py."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from PIL import Image

from normvit_jax import evaluation, per_class


def _batch(rng: np.random.Generator, n: int, c: int, padded: int) -> tuple[np.ndarray, dict]:
    logits = rng.standard_normal((n, c)).astype(np.float32)
    logits[1, 2] = logits[1, 4] = 9.0  # a tie: argmax takes the lower class
    logits[3, 5] = np.nan               # a NaN: argmax (and the top-1 metric) takes its class
    mask = np.array([1] * (n - padded) + [0] * padded, np.float32)
    return logits, {"label": rng.integers(0, c, n).astype(np.int32), "mask": mask}


def test_device_counts_equal_numpy_on_random_logits(monkeypatch):
    rng = np.random.default_rng(0)
    logits, batch = _batch(rng, 40, 6, padded=7)
    pred = np.argmax(logits, -1)
    assert pred[1] == 2 and pred[3] == 5
    real = batch["mask"] > 0
    expected = np.zeros((6, 6), np.int64)
    np.add.at(expected, (batch["label"][real], pred[real]), 1)
    got = jax.jit(per_class.sums)(logits, batch)
    np.testing.assert_array_equal(got["confusion"], expected)
    assert got["confusion"].sum() == 33  # the padded rows count nowhere
    # above the matrix's class limit: each class's images and hits, the same numbers
    monkeypatch.setattr(per_class, "CONFUSION_MAX_CLASSES", 5)
    vec = jax.jit(lambda lg, b: per_class.sums(lg, b))(logits, batch)  # traced anew
    assert sorted(vec) == ["class_examples", "class_hits"]
    np.testing.assert_array_equal(vec["class_examples"], expected.sum(1))
    np.testing.assert_array_equal(vec["class_hits"], np.diagonal(expected))
    names = list("abcdef")
    full = per_class.summarize({"confusion": expected}, names)
    short = per_class.summarize({k: np.asarray(v) for k, v in vec.items()}, names)
    assert short == {k: full[k] for k in ("classes", "examples", "top1")}


def test_summary_of_a_hand_made_matrix(monkeypatch):
    m = np.array([[5, 1, 0, 2],    # cat: 5 of 8, taken for bird twice, dog once
                  [2, 0, 2, 0],    # dog: 0 of 4, taken for cat and fox twice each
                  [0, 0, 0, 0],    # fox: no image in the split
                  [0, 0, 1, 3]])   # bird: 3 of 4
    names = ["cat", "dog", "fox", "bird"]
    s = per_class.summarize({"confusion": m}, names)
    assert s["examples"] == [8, 4, 0, 4]
    assert s["top1"] == [5 / 8, 0.0, None, 3 / 4]
    assert s["confusion"] == m.tolist()
    # most frequent first; equal counts in row-major order (dog->cat before dog->fox)
    assert [(p["true"], p["predicted"], p["count"], p["of"]) for p in s["most_confused"]] == [
        ("cat", "bird", 2, 8), ("dog", "cat", 2, 4), ("dog", "fox", 2, 4), ("cat", "dog", 1, 8),
        ("bird", "fox", 1, 4)]
    assert per_class.describe(s) == (
        "lowest per-class top-1: dog: 0.0% of 4 images (2 taken for cat), cat: 62.5% of 8 "
        "images (2 taken for bird), bird: 75.0% of 4 images (1 taken for fox)")
    assert per_class.describe(s, lowest=1) == (
        "lowest per-class top-1: dog: 0.0% of 4 images (2 taken for cat)")
    monkeypatch.setattr(per_class, "JSON_MATRIX_MAX_CLASSES", 3)  # the matrix stays out
    assert "confusion" not in per_class.summarize({"confusion": m}, names)
    monkeypatch.setattr(per_class, "MOST_CONFUSED", 2)
    assert len(per_class.summarize({"confusion": m}, names)["most_confused"]) == 2
    # a perfect model has no mistakes to list
    perfect = per_class.summarize({"confusion": np.diag([3, 4, 0])}, ["a", "b", "c"])
    assert perfect["most_confused"] == []
    assert per_class.describe(perfect) == "per-class top-1: 100% for every class with images"
    assert per_class.describe(per_class.summarize({"confusion": np.zeros((2, 2), int)}, ["a", "b"])
                              ) == "no class has images"


def test_the_picture_is_drawn_up_to_its_class_limit(tmp_path, monkeypatch):
    m = np.array([[5, 1, 0], [2, 7, 0], [0, 0, 4]])
    s = per_class.summarize({"confusion": m}, ["a very long class name indeed", "b", "c"])
    path = tmp_path / "eval_x_test_confusion_6.png"
    assert per_class.picture(s, "run step 6", path)
    img = np.asarray(Image.open(path).convert("L"), np.float64)
    assert img.shape[0] > 200 and img.shape[1] > 200 and img.std() > 10  # drawn, not blank
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no .tmp left
    monkeypatch.setattr(per_class, "PICTURE_MAX_CLASSES", 2)
    assert not per_class.picture(s, "run", tmp_path / "more.png")
    assert not per_class.picture({k: v for k, v in s.items() if k != "confusion"}, "run",
                                 tmp_path / "none.png")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_names_are_drawn_as_they_are_not_as_tex(tmp_path):
    """A class folder named '$\\alpha$' or 'price $5 $6': matplotlib parsed the names as TeX math
    ('Unknown symbol', a ValueError at savefig) and the eval stopped before its result file."""
    s = per_class.summarize({"confusion": np.array([[3, 1], [0, 2]])}, ["$\\foo$", "price $5 $6"])
    assert per_class.picture(s, "run $\\bar$ step 6", tmp_path / "x.png")
    assert Image.open(tmp_path / "x.png").size[0] > 200


def test_picture_paths_end_in_the_step_as_the_result_files_do(tmp_path):
    from normvit_jax import checkpoints
    json_path = tmp_path / "eval_imagenet2012_train-2-_16.json"
    assert per_class.picture_path(json_path, "").name == \
        "eval_imagenet2012_train-2-_confusion_16.png"
    assert per_class.picture_path(json_path, "ema_").name == \
        "eval_imagenet2012_train-2-_confusion-ema_16.png"
    for p in (json_path, per_class.picture_path(json_path, ""),
              per_class.picture_path(json_path, "ema_"), tmp_path / "eval_x_confusion_6.png"):
        p.write_text("x")
    # what moves aside with a damaged step 16: its results and pictures, not step 6's
    assert [p.name for p in checkpoints.eval_results(str(tmp_path), 16)] == [
        "eval_imagenet2012_train-2-_16.json", "eval_imagenet2012_train-2-_confusion-ema_16.png",
        "eval_imagenet2012_train-2-_confusion_16.png"]


def test_class_names_fall_back_to_the_datasets_then_to_numbers(tmp_path):
    class Spec:
        class_names = ("x", "y", "z")
    assert per_class.class_names(str(tmp_path), Spec, 3) == ["x", "y", "z"]
    (tmp_path / "classes.json").write_text('["a", "b", "c"]')
    assert per_class.class_names(str(tmp_path), Spec, 3) == ["a", "b", "c"]
    (tmp_path / "classes.json").write_text('["a", "b"')  # damaged: the dataset's names
    assert per_class.class_names(str(tmp_path), Spec, 3) == ["x", "y", "z"]
    Spec.class_names = None
    assert per_class.class_names(str(tmp_path), Spec, 3) == ["0", "1", "2"]


def test_the_result_file_keeps_a_list_of_numbers_on_one_line():
    result = {"per_class": {"confusion": [[1, 0], [2, 3]], "top1": [0.5, None, 1e-07],
                            "classes": ["a", "b"]}, "metrics": {"top1": 0.25}}
    text = evaluation.result_json(result)
    assert json.loads(text) == result
    assert "[1, 0]" in text and "[2, 3]" in text and "[0.5, null, 1e-07]" in text
    assert len(text.splitlines()) == 16, text

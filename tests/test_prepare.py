"""``python -m normvit_jax.data.prepare`` on tiny sets made here, read back by plain tfds.

Expected pixels come from the documented RGB rule applied independently (numpy on the source
pixels), never from the code under test.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
from unittest import mock

import numpy as np
import pytest
from PIL import Image

from normvit_jax.data import formats, prepare, prepared
from tests.conftest import REPO_ROOT

RNG = np.random.default_rng(0)


def _run(*argv):
    return prepare.main(list(argv))


def _read_split(path, split):
    import tensorflow_datasets as tfds
    b = tfds.builder_from_directory(path)
    ds = b.as_data_source(split=split)
    recs = [ds[i] for i in range(len(ds))]
    return b, recs


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        _run(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ")
    return err[-1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """src/{train,val}/{cat,dog}: RGB JPEG, gray PNG, RGBA PNG, 16-bit PNG, CMYK JPEG, EXIF-rotated
    JPEG; train/cat/bad.jpg is corrupt, train/dog/notes.txt is not an image. Returns (root, expected
    pixels by relative path for the lossless ones)."""
    root = tmp_path_factory.mktemp("folder")
    want = {}
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            d = root / "src" / split / c
            d.mkdir(parents=True)
            Image.fromarray(RNG.integers(0, 256, (10, 12, 3), np.uint8)).save(d / "rgb.jpg")
            g = RNG.integers(0, 256, (9, 8), np.uint8)
            Image.fromarray(g).save(d / "gray.png")
            want[f"{split}/{c}/gray.png"] = np.repeat(g[..., None], 3, -1)
            a = RNG.integers(0, 256, (8, 9, 4), np.uint8)
            Image.fromarray(a, "RGBA").save(d / "rgba.png")
            want[f"{split}/{c}/rgba.png"] = a[..., :3]  # alpha dropped, not composited
            h = RNG.integers(0, 65536, (11, 8)).astype(np.uint16)
            Image.fromarray(h).save(d / "deep.png")
            h8 = np.rint(h.astype(np.float64) * 255 / 65535).astype(np.uint8)
            want[f"{split}/{c}/deep.png"] = np.repeat(h8[..., None], 3, -1)
            Image.fromarray(RNG.integers(0, 256, (8, 8, 4), np.uint8), "CMYK").save(d / "cmyk.jpg")
            ex = Image.Exif()
            ex[0x0112] = 6  # rotate 90 degrees clockwise to view
            Image.fromarray(RNG.integers(0, 256, (8, 14, 3), np.uint8)).save(d / "exif.jpg", exif=ex)
    (root / "src/train/cat/bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (root / "src/train/dog/notes.txt").write_text("not an image")
    (root / "src/README.txt").write_text("ignored")
    return root, want


@pytest.fixture(scope="module")
def prepared_folder(folder):
    root, want = folder
    info = _run(f"--src={root}/src", "--name=pets", f"--data_dir={root}/dd")
    return root, want, info


def test_folder_is_a_standard_tfds_dataset_with_the_rgb_rule(prepared_folder):
    root, want, info = prepared_folder
    b, recs = _read_split(f"{root}/dd/pets/1.0.0", "val")
    assert b.info.features["label"].names == ["cat", "dog"]
    assert b.info.splits["train"].num_examples == 12 and b.info.splits["val"].num_examples == 12
    assert all(r["image"].dtype == np.uint8 and r["image"].shape[-1] == 3 for r in recs)
    # lossless files: exact pixels, found by content among the split's records
    for rel, px in want.items():
        if rel.startswith("val/"):
            label = 0 if "/cat/" in rel else 1
            hits = [r for r in recs if r["label"] == label and r["image"].shape == px.shape
                    and np.array_equal(r["image"], px)]
            assert len(hits) == 1, rel
    # the EXIF-rotated JPEG (8x14 stored) is upright: 14x8
    assert sum(r["image"].shape[:2] == (14, 8) for r in recs) == 2


def test_folder_summary_skips_and_names_unreadable_files(prepared_folder, capsys):
    root, _, info = prepared_folder
    skipped = info["splits"]["train"]["skipped"]
    assert len(skipped) == 2
    assert any("bad.jpg" in s for s in skipped) and any("notes.txt" in s for s in skipped)
    assert info["splits"]["train"]["per_class"] == [6, 6]
    assert info["eval_split"] == "val" and info["ignored"] == [f"{root}/src/README.txt"]
    d = prepared.describe("pets", f"{root}/dd")
    assert d["classes"] == ["cat", "dog"] and d == json.loads(json.dumps(info))


def _equal_weights(imgs) -> tuple[np.ndarray, np.ndarray]:
    """numpy's per-channel mean and std of images (of at most 64x64 pixels: not resized) in [0, 1]
    with each image weighing the same, whatever its size."""
    px = [x.reshape(-1, 3).astype(np.float64) / 255 for x in imgs]
    mean = np.mean([p.mean(0) for p in px], 0)
    return mean, np.sqrt(np.mean([((p - mean) ** 2).mean(0) for p in px], 0))


def test_stats_are_the_train_images_mean_and_std_each_image_weighing_the_same(prepared_folder):
    root, _, info = prepared_folder
    _, recs = _read_split(f"{root}/dd/pets/1.0.0", "train")
    assert max(r["image"].shape[0] * r["image"].shape[1] for r in recs) <= 64 * 64
    mean, std = _equal_weights([r["image"] for r in recs])
    px = np.concatenate([r["image"].reshape(-1, 3) for r in recs]).astype(np.float64) / 255
    np.testing.assert_allclose(info["stats"]["mean"], mean, atol=2e-6)
    np.testing.assert_allclose(info["stats"]["std"], std, atol=2e-6)
    np.testing.assert_allclose(info["stats"]["max"], px.max(0), atol=1e-6)


def test_strict_refuses_and_leaves_nothing_prepared(folder, capsys):
    root, _ = folder
    msg = _fails(capsys, f"--src={root}/src", "--name=pets_strict", f"--data_dir={root}/dd2",
                 "--strict")
    assert "bad.jpg" in msg or "notes.txt" in msg
    assert not prepared.is_prepared("pets_strict", f"{root}/dd2")
    assert not os.path.exists(f"{root}/dd2/pets_strict")
    # a re-run (here without --strict) starts over and completes
    _run(f"--src={root}/src", "--name=pets_strict", f"--data_dir={root}/dd2")
    assert prepared.is_prepared("pets_strict", f"{root}/dd2")
    assert not os.path.exists(f"{root}/dd2/.pets_strict.partial")


def test_existing_names_and_bad_names_are_refused(prepared_folder, capsys):
    root, _, _ = prepared_folder
    assert "already prepared" in _fails(capsys, f"--src={root}/src", "--name=pets",
                                        f"--data_dir={root}/dd")
    assert "catalog" in _fails(capsys, f"--src={root}/src", "--name=mnist", f"--data_dir={root}/dd")
    # a folder of the name that is no dataset (here the source itself) is never replaced
    for extra in ([], ["--overwrite"]):
        assert _fails(capsys, f"--src={root}/src", "--name=src", f"--data_dir={root}", *extra) == (
            f"error: {root}/src exists and is not a prepared dataset; choose another --name or "
            "--data_dir (--overwrite replaces only a dataset)")
    assert sorted(os.listdir(f"{root}/src")) == ["README.txt", "train", "val"]
    assert "--name='My-Set'" in _fails(capsys, f"--src={root}/src", "--name=My-Set",
                                       f"--data_dir={root}/dd")
    for n in (0, -1):
        assert _fails(capsys, f"--src={root}/src", "--name=pets_w", f"--data_dir={root}/dd",
                      f"--workers={n}") == (f"error: --workers={n}; accepted: an integer >= 1 "
                                            "(leave it out for one per core)")
    assert not os.path.exists(f"{root}/dd/.pets_w.partial")


def test_overwrite_replaces_only_once_the_new_one_is_complete(folder, tmp_path, capsys):
    root, _ = folder
    _run(f"--src={root}/src", "--name=pets", f"--data_dir={tmp_path}", "--val_fraction=0")
    msg = _fails(capsys, f"--src={root}/src", "--name=pets", f"--data_dir={tmp_path}",
                 "--overwrite", "--strict")
    assert "bad.jpg" in msg or "notes.txt" in msg
    assert prepared.describe("pets", str(tmp_path))["splits"]["val"]["examples"] == 12  # old kept
    np.savez(tmp_path / "a.npz", images=np.zeros((4, 8, 8), np.uint8), labels=np.arange(4) % 2)
    _run(f"--src={tmp_path}/a.npz", "--name=pets", f"--data_dir={tmp_path}", "--overwrite",
         "--val_fraction=0")
    assert prepared.describe("pets", str(tmp_path))["format"] == "arrays"
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "pets"]


def test_single_tree_holds_out_a_seeded_fraction_per_class(tmp_path):
    for c in ("a", "b", "c"):
        (tmp_path / "src" / c).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(np.full((8, 8, 3), i * 20, np.uint8)).save(tmp_path / "src" / c / f"{i}.png")
    infos = [_run(f"--src={tmp_path}/src", f"--name=t{k}", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0.2", f"--seed={s}") for k, s in enumerate((3, 3, 4))]
    assert infos[0]["splits"]["validation"]["per_class"] == [2, 2, 2]
    assert infos[0]["splits"]["train"]["per_class"] == [8, 8, 8]
    assert infos[0]["held_out"] == {"split": "validation", "fraction": 0.2, "seed": 3}
    assert infos[0]["eval_split"] == "validation"

    def held(k):
        _, recs = _read_split(f"{tmp_path}/dd/t{k}/1.0.0", "validation")
        return sorted((int(r["label"]), int(r["image"][0, 0, 0])) for r in recs)
    assert held(0) == held(1) and held(0) != held(2)  # same seed same files; other seed others


def test_a_held_out_fraction_leaves_every_class_a_train_example():
    """A class of 1 image at --val_fraction=0.6 (round(0.6) = 1), or of 2 at 0.8, was held out
    whole: written with no train example, never learned, yet evaluated, without a word."""
    labels = np.array([0] * 1 + [1] * 2 + [2] * 10)
    pool = formats.Split(labels, [str(i) for i in range(len(labels))], lambda i: (b"", None))
    train, held = formats.hold_out(pool, 0.8, seed=0)
    assert np.bincount(train.labels, minlength=3).tolist() == [1, 1, 2]  # round(8) of class 2
    assert np.bincount(held.labels, minlength=3).tolist() == [0, 1, 8]
    assert sorted(train.names + held.names, key=int) == pool.names  # each example once


def test_empty_class_folder_and_foreign_test_class_exit_2(tmp_path, capsys):
    (tmp_path / "s1/a").mkdir(parents=True)
    (tmp_path / "s1/b").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "s1/a/x.png")
    assert "s1/b: empty class folder" in _fails(capsys, f"--src={tmp_path}/s1", "--name=e1",
                                                f"--data_dir={tmp_path}/dd")
    for p in ("train/a", "test/zebra"):
        (tmp_path / "s2" / p).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "s2" / p / "x.png")
    assert "'zebra'" in _fails(capsys, f"--src={tmp_path}/s2", "--name=e2",
                               f"--data_dir={tmp_path}/dd")


def test_npz_uint8_and_float_arrays(tmp_path, capsys):
    x = RNG.integers(0, 256, (12, 8, 8, 3), np.uint8)
    y = np.arange(12) % 3
    xt = RNG.random((6, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=np.arange(6) % 3,
             class_names=np.array(["r", "g", "b"]))
    info = _run(f"--src={tmp_path}/d.npz", "--name=arr", f"--data_dir={tmp_path}/dd")
    assert info["classes"] == ["r", "g", "b"] and info["eval_split"] == "test"
    _, tr = _read_split(f"{tmp_path}/dd/arr/1.0.0", "train")
    _, te = _read_split(f"{tmp_path}/dd/arr/1.0.0", "test")
    got = {int(r["image"][0, 0, 0]) * 1000 + int(r["image"][0, 0, 1]): r for r in tr}
    for i in range(12):
        r = got[int(x[i, 0, 0, 0]) * 1000 + int(x[i, 0, 0, 1])]
        np.testing.assert_array_equal(r["image"], x[i])
        assert r["label"] == y[i]
    want_t = np.rint(xt.astype(np.float64) * 255).astype(np.uint8)
    assert sorted(r["image"][..., 0].tobytes() for r in te) == sorted(w.tobytes() for w in want_t)
    assert all(np.array_equal(r["image"][..., 0], r["image"][..., 2]) for r in te)


def test_a_source_of_one_class_is_refused_before_decoding(tmp_path, capsys):
    src = _tree(tmp_path / "s", {"cat": 4})
    assert _fails(capsys, f"--src={src}", "--name=one", f"--data_dir={tmp_path}/dd") == (
        f"error: {src}: one class ('cat'); a classifier needs two or more: one folder per class "
        "(or labels of two or more values)")
    np.savez(tmp_path / "a.npz", images=np.zeros((4, 8, 8), np.uint8), labels=np.zeros(4, int))
    assert "one class ('0')" in _fails(capsys, f"--src={tmp_path}/a.npz", "--name=one",
                                       f"--data_dir={tmp_path}/dd")
    assert not os.path.exists(tmp_path / "dd")


def test_a_damaged_archive_or_array_file_is_named_in_one_line(tmp_path, capsys):
    (tmp_path / "text.npz").write_text("not arrays\n")  # was 'holds pickled Python objects'
    assert _fails(capsys, f"--src={tmp_path}/text.npz", "--name=c0", f"--data_dir={tmp_path}/dd"
                  ) == (f"error: {tmp_path}/text.npz: not an .npz (zip) or .npy file; write the "
                        "arrays with numpy.savez or numpy.save")
    (tmp_path / "cifar-10-binary.tar.gz").write_bytes(gzip.compress(b"x" * 4096)[:300])
    msg = _fails(capsys, f"--src={tmp_path}/cifar-10-binary.tar.gz", "--name=c1",
                 f"--data_dir={tmp_path}/dd")  # the last line of stderr: the whole message
    assert msg.startswith(f"error: {tmp_path}/cifar-10-binary.tar.gz: not a readable tar archive ")
    assert "method gz:" in msg and "method tar:" in msg


def test_bad_arrays_exit_2_naming_the_file(tmp_path, capsys):
    np.savez(tmp_path / "obj.npz", images=np.array([{"a": 1}], dtype=object), labels=np.zeros(1))
    assert "obj.npz" in _fails(capsys, f"--src={tmp_path}/obj.npz", "--name=b1",
                               f"--data_dir={tmp_path}/dd")
    np.savez(tmp_path / "n.npz", images=np.zeros((3, 8, 8), np.uint8), labels=np.zeros(2, int))
    assert "3 images but 2 labels" in _fails(capsys, f"--src={tmp_path}/n.npz", "--name=b2",
                                             f"--data_dir={tmp_path}/dd")
    np.savez(tmp_path / "r.npz", images=np.zeros((3, 8, 8), np.uint8), labels=np.array([0, 1, 5]),
             class_names=np.array(["a", "b"]))
    assert "label 5" in _fails(capsys, f"--src={tmp_path}/r.npz", "--name=b3",
                               f"--data_dir={tmp_path}/dd")
    np.savez(tmp_path / "f.npz", images=np.full((3, 8, 8), 2.0), labels=np.zeros(3, int))
    assert "[0, 1]" in _fails(capsys, f"--src={tmp_path}/f.npz", "--name=b4",
                              f"--data_dir={tmp_path}/dd")


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def test_cifar10_binary_archive(tmp_path):
    x = RNG.integers(0, 256, (7, 3, 32, 32), np.uint8)  # CIFAR stores planes: R, G, B
    y = np.array([0, 9, 3, 3, 1, 2, 5], np.uint8)
    rec = lambda xs, ys: b"".join(bytes([l]) + im.tobytes() for im, l in zip(xs, ys))  # noqa
    _tar(tmp_path / "cifar-10-binary.tar.gz", {
        "cifar-10-batches-bin/data_batch_1.bin": rec(x[:5], y[:5]),
        "cifar-10-batches-bin/test_batch.bin": rec(x[5:], y[5:]),
        "cifar-10-batches-bin/batches.meta.txt": "\n".join("abcdefghij").encode()})
    info = _run(f"--src={tmp_path}/cifar-10-binary.tar.gz", "--name=c10", f"--data_dir={tmp_path}/dd")
    assert info["format"] == "cifar" and info["classes"] == list("abcdefghij")
    _, te = _read_split(f"{tmp_path}/dd/c10/1.0.0", "test")
    by_label = {int(r["label"]): r["image"] for r in te}
    for i in (5, 6):
        np.testing.assert_array_equal(by_label[int(y[i])], x[i].transpose(1, 2, 0))


def _py2_like_batch(x, key, y):
    return pickle.dumps({"batch_label": "b", key: list(map(int, y)),
                         "data": x.reshape(len(x), -1), "filenames": ["f"] * len(x)}, protocol=2)


def test_cifar100_python_pickles_with_restricted_unpickler(tmp_path, capsys):
    x = RNG.integers(0, 256, (6, 3, 32, 32), np.uint8)
    y = np.array([99, 0, 42, 7, 42, 1])
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    (d / "train").write_bytes(_py2_like_batch(x[:4], "fine_labels", y[:4]))
    (d / "test").write_bytes(_py2_like_batch(x[4:], "fine_labels", y[4:]))
    (d / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"n{i}" for i in range(100)]}))
    info = _run(f"--src={d}", "--name=c100", f"--data_dir={tmp_path}/dd")
    assert info["classes"][42] == "n42" and info["splits"]["test"]["per_class"][42] == 1
    _, tr = _read_split(f"{tmp_path}/dd/c100/1.0.0", "train")
    got = {int(r["label"]): r["image"] for r in tr}
    np.testing.assert_array_equal(got[99], x[0].transpose(1, 2, 0))

    class Evil:  # a pickle that would call os.system if unpickled naively
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (d / "test").write_bytes(pickle.dumps({"data": Evil(), "fine_labels": [0]}, protocol=2))
    msg = _fails(capsys, f"--src={d}", "--name=c100b", f"--data_dir={tmp_path}/dd")
    assert "test" in msg and "binary version" in msg and "system" in msg


def _idx(arr, gz):
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    data = head + arr.astype(np.uint8).tobytes()
    return gzip.compress(data) if gz else data


def test_idx_gz_and_raw(tmp_path, capsys):
    x = RNG.integers(0, 256, (8, 12, 12), np.uint8)
    y = np.arange(8) % 4
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(_idx(x[:6], True))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(_idx(y[:6], True))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx(x[6:], False))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx(y[6:], False))
    (tmp_path / "classes.txt").write_text("w\nx\ny\nz\n")
    info = _run(f"--src={tmp_path}", "--name=idx", f"--data_dir={tmp_path}/dd")
    assert info["format"] == "idx" and info["classes"] == list("wxyz")
    assert info["splits"]["test"]["examples"] == 2
    _, te = _read_split(f"{tmp_path}/dd/idx/1.0.0", "test")
    for r in te:
        i = 6 + int(np.flatnonzero(y[6:] == r["label"])[0])
        np.testing.assert_array_equal(r["image"], np.repeat(x[i][..., None], 3, -1))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx(y[5:], False))
    assert "3 labels for 2 images" in _fails(capsys, f"--src={tmp_path}", "--name=idx2",
                                             f"--data_dir={tmp_path}/dd")


def test_rerun_after_a_kill_starts_over(prepared_folder, tmp_path):
    root, _, _ = prepared_folder
    junk = tmp_path / ".pets.partial" / "pets" / "1.0.0"
    junk.mkdir(parents=True)  # what kill -9 leaves: a partial folder that is never read
    (junk / "pets-train.array_record-00000-of-00001").write_bytes(b"half")
    assert not prepared.is_prepared("pets", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not prepared"):
        prepared.describe("pets", str(tmp_path))
    _run(f"--src={root}/src", "--name=pets", f"--data_dir={tmp_path}")
    assert prepared.is_prepared("pets", str(tmp_path))
    assert not (tmp_path / ".pets.partial").exists()


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    np.save(tmp_path / "only.npy", np.zeros((2, 8, 8), np.uint8))
    r = subprocess.run([sys.executable, "-m", "normvit_jax.data.prepare", f"--src={tmp_path}/only.npy",
                        "--name=x1", f"--data_dir={tmp_path}/dd"], capture_output=True, text=True)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "only.npy" in lines[0] and "Traceback" not in r.stderr


def test_detect_formats(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    assert formats.detect(str(tmp_path)) == "idx"
    assert formats.detect(__file__.replace("test_prepare.py", "")) == "folder"


def test_no_readable_image_in_a_split_and_empty_hold_out_exit_2(tmp_path, capsys):
    for c in ("a", "b"):
        (tmp_path / "s/train" / c).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "s/train" / c / "x.png")
    (tmp_path / "s/val/a").mkdir(parents=True)
    (tmp_path / "s/val/a/broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    assert "split 'val' has no readable image" in _fails(
        capsys, f"--src={tmp_path}/s", "--name=n1", f"--data_dir={tmp_path}/dd")
    assert not os.path.exists(f"{tmp_path}/dd/n1") and not os.path.exists(f"{tmp_path}/dd/.n1.partial")
    assert "holds out no example" in _fails(
        capsys, f"--src={tmp_path}/s/train", "--name=n2", f"--data_dir={tmp_path}/dd")


def test_arrays_folder_of_split_files(tmp_path):
    x = RNG.integers(0, 256, (6, 8, 8, 1), np.uint8)
    (tmp_path / "src").mkdir()
    np.savez(tmp_path / "src/train.npz", images=x[:4], labels=np.array([0, 1, 0, 1]))
    np.save(tmp_path / "src/test_images.npy", x[4:].astype(np.uint16) * 257)  # 16-bit rule
    np.save(tmp_path / "src/test_labels.npy", np.array([1, 0]))
    (tmp_path / "src/classes.txt").write_text("no\nyes\n")
    info = _run(f"--src={tmp_path}/src", "--name=arrdir", f"--data_dir={tmp_path}/dd")
    assert info["classes"] == ["no", "yes"] and info["splits"]["test"]["per_class"] == [1, 1]
    _, te = _read_split(f"{tmp_path}/dd/arrdir/1.0.0", "test")
    got = {int(r["label"]): r["image"] for r in te}
    np.testing.assert_array_equal(got[1], np.repeat(x[4], 3, -1))  # v * 257 * 255 / 65535 == v


def _tree(root, counts: dict[str, int], broken: tuple[str, ...] = ()) -> str:
    for c, n in counts.items():
        (root / c).mkdir(parents=True)
        for i in range(n):
            if c in broken:
                (root / c / f"{i}.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
            else:
                Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(root / c / f"{i}.png")
    return str(root)


def test_an_unreadable_class_and_a_hold_out_of_nothing_name_the_classes(tmp_path, capsys):
    """Issue 35, item 5: a class whose files are all unreadable stops with exit 2 naming it (also
    with --val_fraction=0, as docs/data.md says); a fraction that holds out nothing names the
    classes and their sizes and suggests a fraction that works."""
    src = _tree(tmp_path / "s", {"cat": 5, "dog": 3, "zebra": 3}, broken=("zebra",))
    line = _fails(capsys, f"--src={src}", "--name=u1", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0")
    assert "class 'zebra' has no readable train image (3 file(s) skipped, e.g. " in line
    assert "zebra/0.jpg" in line and not os.listdir(tmp_path / "dd")  # nothing left behind
    line = _fails(capsys, f"--src={src}", "--name=u2", f"--data_dir={tmp_path}/dd")
    assert "holds out no example" in line and "'dog' 3, 'zebra' 3, 'cat' 5" in line
    suggested = re.search(r"pass (--val_fraction=[0-9.]+) \(one image of each class\)", line)
    shutil.rmtree(tmp_path / "s" / "zebra")
    info = _run(f"--src={src}", "--name=u3", f"--data_dir={tmp_path}/dd", suggested.group(1))
    assert info["splits"]["validation"]["per_class"] == [1, 1]  # the suggestion holds one each


def test_without_an_eval_split_the_suggested_command_evaluates_on_train(tmp_path, capsys):
    from configs import vit_ln
    from normvit_jax import data
    src = _tree(tmp_path / "s", {"cat": 4, "dog": 4})
    _run(f"--src={src}", "--name=noval", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    out = capsys.readouterr().out
    assert "eval split: none (--val_fraction=0)" in out and "eval split: None" not in out
    command = next(line for line in out.splitlines() if line.startswith("train: python main.py"))
    assert "--config.data.eval_split=train" in command
    config = vit_ln.get_config("demo")  # what the command's flags set, resolved as main.py does
    for flag in command.split()[4:]:
        if flag.startswith("--config.data."):
            key, value = flag[len("--config.data."):].split("=", 1)
            config.data[key] = value
    spec = data.resolve_data_spec(config)
    pipe = data.make_pipeline(config, "eval", spec)  # what the run evaluates on: the 8 images
    assert spec.eval_split == "train" and int(pipe.eval_batch(0)["mask"].sum()) == 8
    pipe.close()


def test_a_source_with_only_a_train_split_is_not_said_to_be_val_fraction_0(tmp_path, capsys):
    """DIR/train/<class> alone (no val/test folder): nothing is held out whatever --val_fraction
    says, and the summary blamed '--val_fraction=0', a flag the user had not passed."""
    src = _tree(tmp_path / "s" / "train", {"cat": 4, "dog": 4})
    _run(f"--src={os.path.dirname(src)}", "--name=trainonly", f"--data_dir={tmp_path}/dd")
    out = capsys.readouterr().out
    assert "--val_fraction=0" not in out, out
    assert ("eval split: none (the source has only a train split; add a val/ or test/ folder of "
            "the same classes): the command below evaluates on 'train'") in out, out


def test_local_prepare_makes_no_network_call_and_checks_arguments_before_tensorflow(tmp_path):
    """Issue 35, item 6: tfds's community catalog is a file on GCS, and listing it made every
    prepare ask TensorFlow for Google credentials and the GCE metadata server."""
    src = _tree(tmp_path / "s", {"cat": 3, "dog": 3})
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "0"}
    r = subprocess.run([sys.executable, "-m", "normvit_jax.data.prepare", f"--src={src}",
                        "--name=local", f"--data_dir={tmp_path}/dd", "--val_fraction=0"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for probe in ("google_auth", "metadata.google.internal", "bearer token"):
        assert probe not in r.stderr, r.stderr[-3000:]
    # TensorFlow's start-up lines once (its two C++ libraries each print them)
    assert r.stderr.count("oneDNN custom operations") <= 1, r.stderr[-3000:]
    assert r.stderr.count("before absl::InitializeLog") <= 1, r.stderr[-3000:]
    code = ("import sys\nfrom normvit_jax.data import prepare\ntry:\n"
            f"    prepare.main(['--src={tmp_path}/none', '--name=x', '--data_dir={tmp_path}/dd'])\n"
            "finally:\n    print('tensorflow' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-2:] == [
        f"error: --src={tmp_path}/none: no such file or folder", "False"], r.stderr[-2000:]


def test_the_suggested_command_trains_on_fewer_images_than_the_batch(tmp_path, capsys):
    """A photo folder of a few dozen images (a new user's first try): the configs' batch of 128 is
    larger than the train split, so the printed command set that batch and stopped at once (not
    one step per epoch); it now sets a batch that fits, and the train pipeline opens."""
    from configs import vit_ln
    from normvit_jax import data
    src = _tree(tmp_path / "s", {"cat": 10, "dog": 10})
    _run(f"--src={src}", "--name=few", f"--data_dir={tmp_path}/dd")
    command = next(line for line in capsys.readouterr().out.splitlines()
                   if line.startswith("train: python main.py"))
    assert "--config=configs/vit_ln.py:small32" in command and "--config.batch_size=16" in command
    config = vit_ln.get_config("small32")  # the command's overrides, parsed as main.py parses them
    for flag in command.split()[4:]:
        if flag.startswith("--config."):
            key, value = flag[len("--config."):].split("=", 1)
            parent = config
            *path, leaf = key.split(".")
            for k in path:
                parent = parent[k]
            parent[leaf] = int(value) if isinstance(parent[leaf], int) else value
    spec = data.resolve_data_spec(config)
    said = []
    with mock.patch("absl.logging.info", lambda msg, *a: said.append(msg % a)):
        pipe = data.make_pipeline(config, "train", spec)  # raised: batch_size=128 > 18 examples
        assert pipe.steps_per_epoch == 1
        pipe.close()
        data.make_pipeline(config, "eval", spec).close()
    # the log says what happens to each split's decoded images (eval batches are not augmented)
    assert [m.split("; ")[1].split(" (")[0] for m in said if m.startswith("Decoded the")] == [
        "its batches are augmented from there", "its batches are read from there"], said


def test_linked_folders_are_read_once_and_a_broken_link_is_skipped_by_name(tmp_path, capsys):
    """A photo folder with symbolic links: a linked sub-folder of a class was dropped silently
    (os.walk does not follow links), a broken link stopped the prepare with a traceback (exit 1),
    and a link back to the source would pull the other classes' files into the class."""
    src = tmp_path / "s"
    _tree(src, {"cat": 3, "dog": 3})
    _tree(tmp_path / "elsewhere", {"more": 2})
    (src / "cat" / "linked").symlink_to(tmp_path / "elsewhere" / "more")  # 2 more cat images
    (src / "cat" / "again").symlink_to(tmp_path / "elsewhere" / "more")   # the same folder twice
    (src / "dog" / "loop").symlink_to("..")                               # src itself
    (src / "dog" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (src / "everything").symlink_to(".")                                  # a class folder = src
    info = _run(f"--src={src}", "--name=links", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    assert info["splits"]["train"]["per_class"] == [5, 3] and info["classes"] == ["cat", "dog"]
    assert info["splits"]["train"]["skipped"] == [
        f"{src}/dog/gone.jpg (a broken symbolic link to {tmp_path}/nowhere.jpg)"]
    assert info["ignored"] == [f"{src}/everything"]


def test_a_png_cut_after_its_pixels_is_stored_decodable_by_training(tmp_path):
    """A PNG whose copy stopped in its last bytes: PIL reads every pixel, TensorFlow's decoder
    (training's) refuses the file. It was stored as it was, and the run stopped at its first
    batch with 'example k of the split cannot be decoded'; it is stored as the PNG of its pixels."""
    import tensorflow as tf
    import tensorflow_datasets as tfds
    src = _tree(tmp_path / "s", {"cat": 2, "dog": 2})
    px = RNG.integers(0, 256, (7, 9, 3), np.uint8)
    Image.fromarray(px).save(tmp_path / "s" / "dog" / "cut.png")
    whole = (tmp_path / "s" / "dog" / "cut.png").read_bytes()
    (tmp_path / "s" / "dog" / "cut.png").write_bytes(whole[:-12])  # without its IEND chunk
    _run(f"--src={src}", "--name=cut", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    ds = tfds.builder_from_directory(f"{tmp_path}/dd/cut/1.0.0").as_data_source(
        split="train", decoders={"image": tfds.decode.SkipDecoding()})
    stored = [tf.io.decode_image(ds[i]["image"], channels=3).numpy() for i in range(len(ds))]
    assert len(stored) == 5 and sum(x.shape == px.shape and (x == px).all() for x in stored) == 1


def _png(px: np.ndarray, damage: str) -> bytes:
    """An 8-bit RGB PNG of ``px`` that PIL decodes and TensorFlow's decoder (training's) refuses:
    'crc' a wrong IDAT CRC, 'chunk' an unknown critical chunk, 'ihdr' two IHDR chunks."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes, crc_xor: int = 0) -> bytes:
        crc = (zlib.crc32(kind + body) ^ crc_xor) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    h, w, _ = px.shape
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    z = zlib.compress(b"".join(b"\x00" + px[y].tobytes() for y in range(h)))
    idat = chunk(b"IDAT", z, crc_xor=0xFF if damage == "crc" else 0)
    extra = {"chunk": chunk(b"ABCD", b"x"), "ihdr": ihdr}.get(damage, b"")
    return b"\x89PNG\r\n\x1a\n" + ihdr + extra + idat + chunk(b"IEND", b"")


def test_pngs_pil_reads_and_tensorflow_refuses_are_skipped_named_not_stored(tmp_path, capsys):
    """A PNG with a damaged IDAT CRC, an unknown critical chunk or two IHDR
    chunks: PIL decodes it, TensorFlow's decoder (training's and evaluation's) does not. prepare
    stored it and exited 0; training then stopped with 'example 3 of the split cannot be decoded:
    Graph execution error:', naming neither the file nor the fix. Each is skipped and named, as a
    truncated file is, and --strict refuses it."""
    import tensorflow as tf
    import tensorflow_datasets as tfds
    src = _tree(tmp_path / "s", {"cat": 2, "dog": 2})
    px = RNG.integers(0, 256, (5, 6, 3), np.uint8)
    damages = ("chunk", "crc", "ihdr")
    for d in damages:
        data = _png(px, d)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), px)
        with pytest.raises(tf.errors.OpError):
            tf.io.decode_image(data, channels=3)
        (tmp_path / "s" / "dog" / f"{d}.png").write_bytes(data)
    info = _run(f"--src={src}", "--name=tfbad", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    why = "TensorFlow's decoder, which evaluation uses, cannot decode it (PIL can: "
    skipped = info["splits"]["train"]["skipped"]
    assert [x.split(" (")[0] for x in skipped] == [f"{src}/dog/{d}.png" for d in damages]
    assert all(f" ({why}" in x for x in skipped), skipped
    assert info["splits"]["train"]["per_class"] == [2, 2]
    assert f"train: skipped 3 unreadable file(s):\n    {src}/dog/chunk.png ({why}" in (
        capsys.readouterr().out)
    ds = tfds.builder_from_directory(f"{tmp_path}/dd/tfbad/1.0.0").as_data_source(
        split="train", decoders={"image": tfds.decode.SkipDecoding()})
    assert [tf.io.decode_image(ds[i]["image"]).shape for i in range(len(ds))] == [(8, 8, 3)] * 4
    line = _fails(capsys, f"--src={src}", "--name=tfbad2", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0", "--strict")
    assert line.startswith(f"error: {src}/dog/chunk.png: cannot be decoded ({why}")
    assert line.endswith("; --strict refuses unreadable images")


def test_split_folders_not_named_as_splits_are_refused_not_read_as_classes(tmp_path, capsys):
    """A download laid out as Train/<class>, Test/<class> (or training_set/test_set) was read as
    one tree of the classes 'Test' and 'Train': a model telling the folders apart, without a
    word. Folders of images named so (no sub-folders) are still classes."""
    for split in ("Train", "Test"):
        _tree(tmp_path / "s" / split, {"cat": 2, "dog": 2})
    line = _fails(capsys, f"--src={tmp_path}/s", "--name=k1", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0")
    assert line == (f"error: {tmp_path}/s: the folders 'Test', 'Train' look like splits, not "
                    "classes; name them train/ and val/, validation/ or test/ (lower case), each "
                    "holding one folder per class, or point --src at one of them")
    _tree(tmp_path / "s2", {"Train": 2, "valid": 2})  # images directly inside: classes
    info = _run(f"--src={tmp_path}/s2", "--name=k2", f"--data_dir={tmp_path}/dd",
                "--val_fraction=0")
    assert info["classes"] == ["Train", "valid"]


def test_a_heic_photo_is_named_as_such_with_what_to_do():
    """iPhone photos are HEIC, which PIL does not decode: the skip reason said only 'not an image
    format PIL recognises'. The header of an iPhone HEIC (an ISO-BMFF 'ftyp' box, brand heic)."""
    from normvit_jax.data import images
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)
    for read in (images.load_file, images.stored_as_is):  # prepare and serve; predict
        with pytest.raises(images.BadImageError, match=r"^a HEIC/HEIF photo, which PIL cannot "
                           r"decode; convert it to JPEG \(macOS: sips"):
            read(heic)
        with pytest.raises(images.BadImageError, match="^not an image format PIL recognises$"):
            read(b"\x00\x00\x00\x18ftypisom" + bytes(64))  # an MP4 video


def test_decoding_runs_at_most_two_images_per_worker_ahead_of_the_writer():
    """Each decoded photo is held until the writer (one thread) takes it: a look-ahead of 256
    images held 256 decoded photos (10+ GB at 12 MP) when many decode threads outran it. The
    writer here stops at its first image until the decoders have run as far ahead as they can
    (or half a second has passed); none may start more than 2 x workers images ahead of it."""
    import threading
    workers, n, taken, lead = 3, 40, [0], []
    far = threading.Event()

    def load(i):
        lead.append(i - taken[0])
        if i >= 2 * workers:
            far.set()
        return b"", np.zeros((1, 1, 3), np.uint8)
    split = formats.Split(np.zeros(n, np.int64), [str(i) for i in range(n)], load)
    writer = prepare._SplitWriter("train", split, 1, False, workers, None)
    for k, _ in writer:
        if k == 0:
            far.wait(0.5)
        taken[0] += 1
    assert taken[0] == n and len(lead) == n and max(lead) <= 2 * workers, max(lead)


def test_a_16_bit_rgb_png_keeps_each_values_high_byte_in_prepare_and_training():
    """docs/data.md's RGB rule: 16-bit gray is scaled and rounded, 16-bit RGB(A) PNGs (which PIL
    opens as 8-bit RGB) keep the high byte; PIL (prepare, serve) and TensorFlow (training,
    predict) agree on it. The doc said 'scaled by 255/65535 and rounded' for every 16-bit image."""
    import struct
    import zlib
    import tensorflow as tf
    from normvit_jax.data import images
    v = np.array([[[0, 255, 256], [32767, 32768, 33023], [65535, 65280, 65279]]], np.uint16)
    chunk = lambda t, d: (struct.pack(">I", len(d)) + t + d  # noqa: E731
                          + struct.pack(">I", zlib.crc32(t + d)))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 3, 1, 16, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\x00" + v[0].astype(">u2").tobytes()))
           + chunk(b"IEND", b""))
    stored, rgb = images.load_file(png)
    # 255 -> 0 (rounding: 1), 65280 -> 255 (rounding: 254)
    assert (rgb == (v >> 8)).all() and stored == png
    assert (tf.io.decode_image(stored, channels=3).numpy() == rgb).all()


def test_the_summary_names_ten_skipped_files_per_split_and_points_to_the_rest(tmp_path, capsys):
    """A Google Takeout folder has a .json beside every photo: the summary printed one line per
    skipped file, thousands of lines above the statistics and the command to train."""
    src = _tree(tmp_path / "s", {"cat": 4, "dog": 4})
    for i in range(12):
        (tmp_path / "s" / "cat" / f"{i}.png.json").write_text("{}")
    info = _run(f"--src={src}", "--name=sidecars", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    out = capsys.readouterr().out.splitlines()
    assert len(info["splits"]["train"]["skipped"]) == 12  # all in prepare.json
    start = out.index("  train: skipped 12 unreadable file(s):")
    assert all(line.endswith(".png.json (not an image format PIL recognises)")
               for line in out[start + 1:start + 11])
    assert out[start + 11] == (f"    ... and 2 more, all listed in {tmp_path}/dd/sidecars/1.0.0/"
                               "prepare.json")
    assert not out[start + 12].startswith("    ")  # the list ends there


def test_names_that_are_not_utf8_are_refused_for_a_class_and_printable_for_a_file(tmp_path,
                                                                                  capsys):
    """Folders unzipped from an old Windows archive have names in cp1252 bytes: a class folder
    so named decoded every image, then stopped in tfds with a UnicodeEncodeError's traceback; a
    skipped file so named made the summary's print fail in a UTF-8 terminal (a traceback)."""
    src = _tree(tmp_path / "s", {"cat": 2, "dog": 2})
    bad_class = os.path.join(os.fsencode(src), b"caf\xe9")
    os.mkdir(bad_class)
    shutil.copy(os.path.join(src, "cat", "0.png"), os.path.join(bad_class, b"0.png"))
    line = _fails(capsys, f"--src={src}", "--name=u8", f"--data_dir={tmp_path}/dd",
                  "--val_fraction=0")
    assert line.startswith(f"error: {src}/caf\\xe9: the class folder's name is not valid UTF-8")
    shutil.rmtree(bad_class)
    with open(os.path.join(os.fsencode(src), b"cat", b"notes\xff.jpg"), "wb") as f:
        f.write(b"not an image")
    _run(f"--src={src}", "--name=u8", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    out = capsys.readouterr().out
    out.encode("utf-8")  # printable in a UTF-8 terminal (strict): no lone surrogate
    assert f"    {src}/cat/notes\\xff.jpg (not an image format PIL recognises)" in out


def test_synology_thumbnail_folders_are_skipped_like_hidden_ones(tmp_path):
    """A photo share on a Synology NAS has an @eaDir folder in every folder, with thumbnails of
    each photo: they were read as more images of the class (and of a class '@eaDir' at the top),
    near-copies of the photos in both train and validation."""
    src = _tree(tmp_path / "s", {"cat": 3, "dog": 3})
    for where in ("cat/@eaDir/0.png", "dog/sub/@eaDir/1.png", "@eaDir/cat"):
        d = tmp_path / "s" / where
        d.mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(d / "SYNOPHOTO_THUMB_M.jpg")
    info = _run(f"--src={src}", "--name=nas", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    assert info["classes"] == ["cat", "dog"] and info["splits"]["train"]["per_class"] == [3, 3]
    from normvit_jax import predict  # --images reads folders alike
    assert predict.list_images(f"{src}/cat") == [f"{src}/cat/{i}.png" for i in range(3)]


def test_a_macs_zip_folder_beside_the_classes_is_skipped(tmp_path):
    """A zip made on a Mac unzips with a __MACOSX folder beside the class folders (its ._* files
    are resource forks, no images): prepare stopped with 'empty class folder'."""
    src = _tree(tmp_path / "s", {"cat": 3, "dog": 3})
    for where in ("__MACOSX/cat", "cat/__MACOSX"):
        d = tmp_path / "s" / where
        d.mkdir(parents=True)
        (d / "._0.png").write_bytes(b"\x00\x05\x16\x07" + b"\x00" * 60)
    info = _run(f"--src={src}", "--name=mac", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    assert info["classes"] == ["cat", "dog"] and info["splits"]["train"]["per_class"] == [3, 3]


def test_a_camera_raw_files_preview_is_not_taken_for_the_photo():
    """A Nikon .NEF or a .DNG is a TIFF whose first image is a small preview (NewSubfileType 1),
    which PIL opened: a RAW + JPEG folder held each photo twice, once as a 160x120 thumbnail. A
    plain TIFF (no such tag, or 0) is an image as before."""
    from PIL import TiffImagePlugin
    from normvit_jax.data import images
    px = RNG.integers(0, 256, (120, 160, 3), np.uint8)
    for tag, ok in ((1, False), (0, True), (None, True)):
        info = TiffImagePlugin.ImageFileDirectory_v2()
        if tag is not None:
            info[254] = tag
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, "TIFF", tiffinfo=info)
        if ok:
            assert (images.load_file(buf.getvalue())[1] == px).all()
        else:
            with pytest.raises(images.BadImageError, match=r"^its first image is a 160x120 "
                               r"preview \(a camera RAW file: .NEF, .DNG, ...\)"):
                images.load_file(buf.getvalue())


def test_identical_images_under_two_classes_or_in_two_splits_are_noted(tmp_path, capsys):
    """A photo copied into two class folders is trained with both labels, one in train and in
    val is evaluated on an image the model trained on: both were written without a word."""
    px = [RNG.integers(0, 256, (6, 6, 3), np.uint8) for _ in range(5)]
    for rel, k in (("train/cat/a.png", 0), ("train/cat/b.png", 1), ("train/cat/same.png", 1),
                   ("train/dog/c.png", 2), ("train/dog/a_copy.png", 0),
                   ("val/cat/d.png", 3), ("val/dog/c_again.png", 2), ("val/dog/e.png", 4)):
        (tmp_path / "s" / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(px[k]).save(tmp_path / "s" / rel)
    info = _run(f"--src={tmp_path}/s", "--name=copies", f"--data_dir={tmp_path}/dd")
    s = f"{tmp_path}/s"
    assert [(c["file"], c["copy_of"]) for c in info["copies"]] == [  # same class, same split: no
        (f"{s}/train/dog/a_copy.png", f"{s}/train/cat/a.png"),
        (f"{s}/val/dog/c_again.png", f"{s}/train/dog/c.png")]
    assert info["copies"][1]["copy_split"] == "train" and info["copies"][1]["label"] == "dog"
    assert (f"  note: 2 image(s) are byte-identical to an earlier one: 1 under another class "
            f"(trained with both labels), 1 in another split (evaluated on an image trained on); "
            f"e.g. {s}/train/dog/a_copy.png (train, dog) = {s}/train/cat/a.png (train, cat); all "
            f"in prepare.json ('copies')") in capsys.readouterr().out.splitlines()


def test_a_camera_jpeg_with_more_images_is_stored_as_it_is():
    """Many cameras' and phones' .jpg files carry a preview or depth map after the photo (PIL's
    'MPO'): it was re-encoded as a PNG 3-5x its size, though TensorFlow's decoder (training's)
    reads the photo, its first image, exactly as PIL does."""
    import tensorflow as tf
    from normvit_jax.data import images
    photo, preview = (Image.fromarray(RNG.integers(0, 256, (30, 40, 3), np.uint8))
                      for _ in range(2))
    buf = io.BytesIO()
    photo.save(buf, "MPO", save_all=True, append_images=[preview])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"
    stored, rgb = images.load_file(data)
    assert stored is data and images.stored_as_is(data)  # prepare and predict alike
    decoded = tf.io.decode_and_crop_jpeg(data, [0, 0, 30, 40], channels=3,
                                         dct_method="INTEGER_ACCURATE").numpy()
    alone = io.BytesIO()
    photo.save(alone, "JPEG")  # the photo, not the preview, as a plain JPEG decodes
    assert (decoded == rgb).all() and (rgb == np.asarray(Image.open(alone))).all()


def test_class_names_that_differ_only_in_case_or_spaces_are_noted(tmp_path, capsys):
    """Folders merged from two sources, 'cat' and 'Cat ' (a trailing space): two classes the
    model is asked to tell apart, which tfds's label file even shows as 'Cat' and 'cat'."""
    src = _tree(tmp_path / "s", {"cat": 2, "Cat ": 2, "dog": 2, "A": 2, "a": 2})
    _run(f"--src={src}", "--name=alike", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    assert ("  note: class names that differ only in case or spaces: 'A' and 'a'; 'Cat ' and "
            "'cat'; they are separate classes (merge the folders if they are one)"
            ) in capsys.readouterr().out.splitlines()


def test_strict_stops_without_decoding_the_images_waiting_in_the_window():
    """--strict's refusal of the first image must not wait for the images queued behind it (the
    pool's shutdown ran every queued decode: with big photos, seconds each)."""
    import time
    from normvit_jax.data import images
    started = []

    def load(i):
        started.append(i)
        if i == 0:
            raise images.BadImageError("not an image format PIL recognises")
        time.sleep(0.2)  # a decode; the refusal comes while 1..3 run and 4, 5 wait
        return b"", np.zeros((1, 1, 3), np.uint8)
    split = formats.Split(np.zeros(6, np.int64), [str(i) for i in range(6)], load)
    with pytest.raises(formats.PrepareError, match="^0: cannot be decoded"):
        list(prepare._SplitWriter("train", split, 1, True, 3, None))
    assert sorted(started) == [0, 1, 2, 3], started


def test_a_video_among_the_photos_is_skipped_from_its_first_bytes(tmp_path, monkeypatch):
    """A camera roll holds videos of gigabytes: each was read whole into memory (one per decode
    thread) for PIL to say 'not an image format PIL recognises'. It is now named a video from
    its first bytes, and the rest is not read; images that start alike (a GIF's 'G', WebP's
    RIFF, HEIC's and AVIF's ftyp) are not taken for videos."""
    from normvit_jax.data import images
    src = _tree(tmp_path / "s", {"cat": 2, "dog": 2})
    with open(tmp_path / "s" / "dog" / "VID_0001.MOV", "wb") as f:
        f.write(b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00qt  ")
        f.truncate(64 << 20)  # sparse: 64 MiB of video data
    reads = []
    real_read_file = images.read_file
    monkeypatch.setattr(images, "read_file", lambda p: reads.append(p) or real_read_file(p))
    info = _run(f"--src={src}", "--name=vid", f"--data_dir={tmp_path}/dd", "--val_fraction=0")
    assert info["splits"]["train"]["skipped"] == [
        f"{src}/dog/VID_0001.MOV (a video (MP4/MOV), not an image)"]
    assert len(reads) == 5  # every file went through the head check
    ts = (b"\x47" + bytes(187)) * 3
    assert [images.video_kind(h) for h in (
        ts, bytes(4) + ts, b"RIFF\x00\x00\x00\x00AVI LIST", b"\x1a\x45\xdf\xa3" + bytes(8),
        b"\x00\x00\x00\x18ftypmp42", b"GIF89a" + bytes(600), b"RIFF\x00\x00\x00\x00WEBPVP8 ",
        b"\x00\x00\x00\x18ftypheic", b"\x00\x00\x00\x1cftypavif")] == [
        "MPEG-TS (.MTS)", "MPEG-TS (.MTS)", "AVI", "MKV/WebM", "MP4/MOV", None, None, None, None]


def test_windows_thumbnail_and_folder_files_are_skipped_like_hidden_ones(tmp_path):
    """Windows Explorer leaves Thumbs.db and desktop.ini in photo folders: each was an
    'unreadable image' of its class, held out like a photo (validation got fewer photos than
    --val_fraction of them), and --strict refused the folder. torchvision's ImageFolder never
    reads them (its extension list)."""
    src = _tree(tmp_path / "s", {"cat": 4, "dog": 4})
    for c in ("cat", "dog"):
        (tmp_path / "s" / c / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" * 64)
        (tmp_path / "s" / c / "DESKTOP.INI").write_text("[.ShellClassInfo]\n")
        (tmp_path / "s" / c / "ehthumbs.db").write_bytes(b"\x00" * 64)
    info = _run(f"--src={src}", "--name=win", f"--data_dir={tmp_path}/dd", "--val_fraction=0.25",
                "--strict")
    # round(0.25 * 4 photos) = 1 held out per class, from the photos only
    assert info["splits"]["validation"]["per_class"] == [1, 1]
    assert info["splits"]["train"]["per_class"] == [3, 3]
    assert info["splits"]["train"]["skipped"] == info["splits"]["validation"]["skipped"] == []
    from normvit_jax import predict  # --images reads folders alike
    assert predict.list_images(f"{src}/cat") == [f"{src}/cat/{i}.png" for i in range(4)]


@pytest.mark.parametrize("orientation,turned", [(0, False), (65535, False), (6, True)])
def test_a_jpeg_whose_exif_orientation_is_no_turn_is_stored_as_it_is(orientation, turned):
    """EXIF Orientation 0 (or another value outside 1..8), written by some cameras and apps, turns
    nothing (PIL's exif_transpose): such a JPEG was stored as a PNG of its pixels, 3-5x larger and
    decoded whole by training. 6 (a phone held upright) is turned, as before."""
    from PIL import ImageOps
    from normvit_jax.data import images
    rgb = np.random.default_rng(orientation).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", exif=exif.tobytes())
    data = buf.getvalue()
    stored, pixels = images.load_file(data)
    reference = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    np.testing.assert_array_equal(pixels, reference)  # PIL's pixels, turned where it turns them
    assert pixels.shape == ((20, 12, 3) if turned else (12, 20, 3))
    assert (stored == data) is not turned and (images.as_stored(data) == data) is not turned


def test_pil_metadata_and_large_photo_warnings_are_not_printed_by_the_tools():
    """A JPEG with a damaged EXIF block (PIL: 'Corrupt EXIF data', UserWarning) and a photo over
    PIL's 89 MP warning limit (a 108 MP phone photo; here the limit is lowered) decode, and each
    printed two lines on stderr naming no file ('could be decompression bomb DOS attack')."""
    import struct
    import warnings
    from normvit_jax import logs
    from normvit_jax.data import images
    rgb = np.random.default_rng(3).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG")
    app1 = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x05\x00"  # an IFD of 5 entries, cut short
    jpeg = buf.getvalue()
    damaged = jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        images.load_file(damaged)
        with mock.patch.object(Image, "MAX_IMAGE_PIXELS", 200):  # 240 pixels: over, not 2x over
            images.load_file(jpeg)
        assert len(seen) == 2, [str(w.message) for w in seen]  # what PIL says without the filter
        seen.clear()
        logs.quiet_library_logs()
        _, pixels = images.load_file(damaged)
        with mock.patch.object(Image, "MAX_IMAGE_PIXELS", 200):
            images.load_file(jpeg)
    assert seen == [], [str(w.message) for w in seen]
    np.testing.assert_array_equal(pixels, np.asarray(Image.open(io.BytesIO(jpeg))))


def test_sidecar_files_are_not_held_out_in_place_of_photos(tmp_path):
    """Google Takeout writes a .json beside each photo (Lightroom an .xmp, an iPhone export an
    .AAE): they were held out like photos, so --val_fraction=0.25 of 4 photos and 4 sidecars held
    out 2 files of which 0-2 photos. Now the photos alone are counted and held out; the sidecars
    stay in train, skipped there and named."""
    src = _tree(tmp_path / "s", {"cat": 4, "dog": 4})
    for c in ("cat", "dog"):
        for i in range(4):
            (tmp_path / "s" / c / f"{i}.png.json").write_text('{"title": "%d.png"}' % i)
    info = _run(f"--src={src}", "--name=side", f"--data_dir={tmp_path}/dd", "--val_fraction=0.25")
    val, train = info["splits"]["validation"], info["splits"]["train"]
    assert val["per_class"] == [1, 1] and val["skipped"] == []  # round(0.25 * 4 photos)
    assert train["per_class"] == [3, 3] and len(train["skipped"]) == 8
    # the photos held out are those hold_out draws from the photos alone (seed 0); _tree's
    # image i is filled with the value i
    pool = formats.Split(np.repeat([0, 1], 4), [str(i) for i in range(4)] * 2, lambda i: None)
    _, held = formats.hold_out(pool, 0.25, 0)
    _, recs = _read_split(str(tmp_path / "dd" / "side" / "1.0.0"), "validation")
    assert sorted((int(r["label"]), int(r["image"][0, 0, 0])) for r in recs) == sorted(
        zip(held.labels.tolist(), map(int, held.names)))


def test_images_decoded_ahead_hold_no_pixels_and_the_statistics_are_exact():
    """The train histogram was taken by the writer, one thread (0.33 s per 12 MP photo, three
    times a decode: prepare ran at ~3 photos/s on any number of cores), so each image decoded
    ahead was held as its pixels (144 MB at 48 MP, 2 x workers of them). The decode threads now
    take it: what waits for the writer is the stored bytes, the size and the histogram."""
    import threading
    import weakref
    from normvit_jax.data import images
    workers, n, alive, ready = 2, 9, [], threading.Event()

    def pixels(i):
        return np.random.default_rng(i).integers(0, 256, (5 + i, 7, 3), dtype=np.uint8)

    def load(i):
        rgb = pixels(i)
        alive.append(weakref.ref(rgb))
        if len(alive) == 2 * workers:  # image 0 and those decoded ahead of it
            ready.set()
        return images.encode_png(rgb), rgb
    split = formats.Split(np.arange(n) % 2, [str(i) for i in range(n)], load)
    stats = prepare._Stats()
    writer = prepare._SplitWriter("train", split, 2, False, workers, stats)
    for k, _ in writer:
        if k == 0:  # the decoders run 2 x workers ahead; their images wait for the writer
            assert ready.wait(10)
            import gc
            import time
            for _ in range(300):  # the last one may still be decoding: until it is done
                gc.collect()
                held = [r for r in alive[1:] if r() is not None]
                if not held:
                    break
                time.sleep(0.01)
            assert held == [], f"{len(held)} decoded images held ahead of the writer"
    x = np.concatenate([pixels(i).reshape(-1, 3) for i in range(n)]).astype(np.float64) / 255
    mean, std = _equal_weights([pixels(i) for i in range(n)])
    got = stats.result()  # each image weighing the same, float64, 6 decimals
    np.testing.assert_allclose(got["mean"], mean, atol=1e-6)
    np.testing.assert_allclose(got["std"], std, atol=1e-6)
    assert got["min"] == x.min(0).tolist() and got["max"] == x.max(0).tolist()


def test_a_class_name_in_its_decomposed_unicode_form_is_the_same_class(tmp_path, capsys):
    """A class folder named on a Mac and copied (zip, rsync) keeps the decomposed form (NFD:
    'e' + U+0301), which prints as the composed 'é': val/café was refused as 'not a class of
    train' next to train/café. Both forms in one split are refused naming the two folders."""
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    _tree(tmp_path / "s" / "train", {nfc: 3, "dog": 3})
    _tree(tmp_path / "s" / "val", {nfd: 2, "dog": 1})
    info = _run(f"--src={tmp_path / 's'}", "--name=nfd", f"--data_dir={tmp_path}/dd")
    assert info["classes"] == [nfc, "dog"] and info["splits"]["val"]["per_class"] == [2, 1]
    _tree(tmp_path / "s2", {nfc: 2, nfd: 2, "dog": 2})
    line = _fails(capsys, f"--src={tmp_path / 's2'}", "--name=nfd2", f"--data_dir={tmp_path}/dd")
    assert "one class name written in two Unicode forms" in line and "merge the two" in line


def test_the_summary_says_1_example_and_help_shows_the_seeds_default(prepared_folder, capsys):
    """'val: 1 examples'; `prepare --help` showed no default for --seed (0, which the help
    formatter took for False) while the other flags showed theirs."""
    root, _, info = prepared_folder
    one = json.loads(json.dumps(info))
    one["splits"]["val"].update(examples=1, per_class=[1, 0])
    text = prepare.summary(one, "pets", f"{root}/dd", 1.0)
    assert "  val: 1 example (cat 1, dog 0)" in text and "  train: 12 examples (" in text
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    assert re.search(r"--seed SEED\s+seed of the held-out choice \(default: 0\)",
                     capsys.readouterr().out)


def _png_header(w: int, h: int) -> bytes:
    """A PNG of w x h pixels whose data is never reached: PIL's and the limit's checks read the
    header only."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _jpeg_header(w: int, h: int) -> bytes:
    """An 8x8 JPEG whose frame header says w x h (its data is never decoded here)."""
    import struct
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    sof = data.index(b"\xff\xc0")
    return data[:sof + 5] + struct.pack(">HH", h, w) + data[sof + 9:]


def test_a_200_megapixel_phone_photo_is_under_the_limit_and_a_bomb_is_refused_by_size():
    """A 200 MP phone photo (16320x12240) was skipped by prepare and predict as PIL's
    'DecompressionBombError ... could be decompression bomb DOS attack' (PIL's default refuses
    over 179 MP). The limit is images.MAX_FILE_PIXELS, 250 MP; an image over it is named by its
    size in megapixels and the limit."""
    from normvit_jax.data import images
    from normvit_jax.deploy import preprocess
    from normvit_jax.serve import DEFAULT_MAX_PIXELS
    assert images.MAX_FILE_PIXELS == 250_000_000
    phone = _jpeg_header(16320, 12240)
    assert images.stored_as_is(phone)  # the header is read, not refused
    preprocess.check_pixels(phone, DEFAULT_MAX_PIXELS, {"eval_resize_small": 0}, as_is=False)
    for w, h, mp in ((20000, 20000, 400), (40000, 20000, 800)):  # PIL's own error past 2x
        for read in (images.stored_as_is, images.load_file):
            with pytest.raises(images.BadImageError) as e:
                read(_png_header(w, h))
            size = f"{w}x{h} = " if mp <= 500 else ""  # past 2x, PIL refuses it unread
            assert str(e.value) == (
                f"an image of {size}{mp} megapixels, over the limit of 250 megapixels that "
                "prepare and predict decode (a decompression bomb, or a photo to scale down "
                "first)"), str(e.value)


def test_stored_as_is_and_load_file_say_the_same_of_a_file_pil_cannot_open():
    """stored_as_is (predict's header look) and load_file (prepare's decode) share one mapping of
    PIL's errors (images._pil_errors): the same file gets the same one line from both."""
    import io as _io

    from normvit_jax.data import images
    buf = _io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    png = buf.getvalue()
    for data in (b"hello, not an image", _png_header(40000, 20000), _png_header(20000, 20000),
                 png[:20], b""):
        said = []
        for read in (images.stored_as_is, images.load_file):
            with pytest.raises(images.BadImageError) as e:
                read(data)
            said.append(str(e.value))
        assert said[0] == said[1] and said[0], said


def test_each_train_image_counts_equally_in_the_statistics_as_the_model_sees_it():
    """prepare's mean/std counted every pixel at full resolution: one 8000x6000 photo outweighed
    thousands of small images, while training sees each at the same small size. Each image now
    counts once, as its 64x64 resize (images of at most 64x64 pixels as they are): a white
    300x200 image and a black 10x10 one average to 0.5; a 1-pixel checkerboard of 128x128 is
    uniform grey at 64x64 (std ~0; its full-resolution pixels' std is 0.5)."""
    def stats_of(*rgbs):
        split = formats.Split(np.zeros(len(rgbs), np.int64), [str(i) for i in range(len(rgbs))],
                              lambda i: (b"", rgbs[i]))
        stats = prepare._Stats()
        for _ in prepare._SplitWriter("train", split, 1, False, 1, stats):
            pass
        return stats.result()
    got = stats_of(np.full((200, 300, 3), 255, np.uint8), np.zeros((10, 10, 3), np.uint8))
    assert got["mean"] == [0.5] * 3 and got["std"] == [0.5] * 3
    assert got["min"] == [0.0] * 3 and got["max"] == [1.0] * 3
    board = (np.indices((128, 128)).sum(0) % 2 * 255).astype(np.uint8)[..., None].repeat(3, -1)
    got = stats_of(board)
    np.testing.assert_allclose(got["mean"], 0.5, atol=0.003)
    assert max(got["std"]) < 0.01, got
    assert got["min"] == [0.0] * 3 and got["max"] == [1.0] * 3  # its pixels' own


def test_min_and_max_are_the_full_resolution_pixels():
    """min/max came from the 64x64 antialiased resize, which smooths extremes away: a 200x200
    image at 100 with one pixel at 255 and one at 0 gave min 0.376 and max 0.420, so
    data.normalize=minmax mapped its real pixels far outside [0, 1]."""
    rgb = np.full((200, 200, 3), 100, np.uint8)
    rgb[5, 7], rgb[150, 120] = 255, 0
    split = formats.Split(np.zeros(1, np.int64), ["0"], lambda i: (b"", rgb))
    stats = prepare._Stats()
    for _ in prepare._SplitWriter("train", split, 1, False, 1, stats):
        pass
    got = stats.result()
    assert got["min"] == [0.0] * 3 and got["max"] == [1.0] * 3, got
    np.testing.assert_allclose(got["mean"], 100 / 255, atol=0.01)


def test_no_empty_tfds_folders_left_in_the_temporary_folder(tmp_path, monkeypatch):
    """tfds's look for a dataset's info on GCS (a builder whose dataset_info.json is not there
    yet) left an empty tmpXXXXtfds folder in /tmp per call: 4258 of them after test runs. Preparing
    a dataset, opening it and being refused a dataset not prepared leave none."""
    import glob
    import tempfile

    from normvit_jax.data import DatasetNotFoundError, prepared, tfds_source
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("ant", "bee"):
            d = tmp_path / "src" / split / name
            d.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 255, (12, 10, 3), np.uint8)).save(d / f"{i}.png")
    dd = str(tmp_path / "dd")
    prepare.main([f"--src={tmp_path / 'src'}", "--name=tiny_tmp", f"--data_dir={dd}"])
    prepared.builder("tiny_tmp", dd)
    tfds_source.open_builder("tiny_tmp", dd, random_access=True)
    with pytest.raises(DatasetNotFoundError):
        tfds_source.open_builder("mnist", dd, random_access=True)
    assert glob.glob(str(tmp / "tmp*tfds")) == []


def test_the_tfds_folder_cleanup_removes_only_the_folders_its_own_call_made(tmp_path, monkeypatch):
    """The cleanup removed every new empty tmp*tfds folder in the temporary folder at the end of
    the block (prepare's runs for hours), those another process or thread had just made too (a
    concurrent tfds download, parallel test workers). Only the block's own thread's are removed."""
    import tempfile
    import threading

    from normvit_jax.data import tfds_source
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other_thread = []
    with tfds_source.no_stray_tmp_folders():
        own = tempfile.mkdtemp("tfds")  # as tfds's DatasetInfo.initialize_from_bucket
        other_process = tmp_path / "tmpab12cd34tfds"
        other_process.mkdir()
        t = threading.Thread(target=lambda: other_thread.append(tempfile.mkdtemp("tfds")))
        t.start()
        t.join()
        kept_own = tempfile.mkdtemp("tfds")
        open(os.path.join(kept_own, "f"), "w").close()  # not empty: kept
    assert not os.path.exists(own)
    assert other_process.is_dir() and os.path.isdir(other_thread[0]) and os.path.isdir(kept_own)
    assert tempfile.mkdtemp is tfds_source._original_mkdtemp
